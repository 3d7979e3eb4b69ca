"""The router's stall deadline for real: two instances of the tiny model on local Ray, one of
which stops stepping for 5 s (its rank sleeps in a step) while it streams an answer.

The client must get the answer once, equal to a cold answer, from the other instance; the
router shows the stall and takes the instance back once it steps again; /metrics counts it.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import time

import pytest
import requests
from eventually import eventually
from http_client import ServeClient
from shared_serve import BASE
from stalling_rank import arm_stall, served_stalling, stall_file

from kvtier.frontend.settings import ServeSettings

KEY = "test-admin-key-stall-0123456789"
SETTINGS = ServeSettings(model="tiny", instances=2, page_size=16, chunk_tokens=64,
                         device_pages=96, max_new_tokens=32, dtype="fp32", admin_key=KEY,
                         storage_backend=None, stall_timeout_s=2.0)
STALL_S = 5.0
PROMPT = "Record 42 of the kvtier ledger says: " * 3

pytestmark = pytest.mark.timeout(300)
CLIENT = ServeClient(BASE, SETTINGS.served_model_name, KEY)


@pytest.fixture(scope="module")
def app():
    with served_stalling(SETTINGS):
        yield




def wait_for(what, description: str, timeout_s: float = 30.0):
    """`what()` once it is true (bounded); a failure shows the router's state."""
    def found():
        if got := what():
            return got
        raise AssertionError(f"router: {CLIENT.router()}")

    return eventually(found, timeout_s, description, retry_on=(AssertionError,),
                      interval_s=0.1)


def test_a_stalled_instance_is_routed_around_and_taken_back(app):
    cold = CLIENT.complete(PROMPT, 24)  # the reference: a cold answer
    arm_stall(after_steps=3, seconds=STALL_S)  # a few tokens out, then 5 s without a step
    start = time.monotonic()
    r = requests.post(f"{BASE}/v1/completions", timeout=120, stream=True,
                      json={"model": SETTINGS.served_model_name, "prompt": PROMPT,
                            "max_tokens": 24, "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}})
    arrived = [(time.monotonic(), line[len(b"data: "):]) for line in r.iter_lines() if line]
    took_s = time.monotonic() - start
    events = [event for _, event in arrived]
    gaps = [(later[0] - earlier[0], i) for i, (earlier, later) in
            enumerate(zip(arrived, arrived[1:]), start=1)]
    gap_s, sent_before = max(gaps)
    assert gap_s >= SETTINGS.stall_timeout_s and sent_before >= 1  # text came, then the stall
    assert not os.path.exists(stall_file())  # a rank took the stall
    assert events[-1] == b"[DONE]" and events.count(b"[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == cold["choices"][0]["text"]  # every token once, in order
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [f for f in finishes if f] == ["length"]
    assert chunks[-1]["usage"]["completion_tokens"] == 24
    served_by = chunks[-1]["kvtier"]["instance"]
    assert chunks[-1]["kvtier"]["moves"] == 1  # it left the stalled instance once
    stalled = wait_for(lambda: [n for n, i in CLIENT.router().items() if i["stalls"]],
                       "the router counted a stall")
    assert stalled != [served_by] and len(stalled) == 1, CLIENT.router()
    assert took_s < STALL_S, "the answer waited for the stalled instance"

    name = stalled[0]  # it steps again after its sleep: live, its cancelled request freed
    wait_for(lambda: CLIENT.router()[name]["state"] == "live"
             and CLIENT.router()[name]["load"] == 0, "the stalled instance was live again",
             timeout_s=STALL_S + 10)

    def one(i: int) -> str:
        answer = CLIENT.complete(f"Question {i}: what does record {i} say?", 4)
        return answer["kvtier"]["instance"]

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert name in set(pool.map(one, range(16)))  # it serves again

    def counted() -> bool:
        body = requests.get(f"{BASE}/metrics", timeout=30).text
        return (f'kvtier_instance_stalls_total{{kvtier_instance="{name}"}} 1.0' in body and
                f'kvtier_redispatched_requests_total{{kvtier_instance="{name}"}} 1.0' in body)

    wait_for(counted, "/metrics counted the stall and the re-sent request")
