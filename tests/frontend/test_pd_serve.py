"""The serve graph with prefill/decode disaggregation for real: one prefill and one decode
instance of the tiny model (TP 1, a file L3) behind the ingress, the KV handed over NIXL
(UCX on loopback). Answers equal the model's own (greedy), each says how it went through the
stages (`kvtier.pd`), the metrics count the bytes moved, and the endpoints PD does not serve
say so."""
from __future__ import annotations

import json

import pytest
import requests
from eventually import eventually
from http_client import ServeClient
from shared_serve import BASE, greedy_chat, in_process_answer, served

from kvtier.engine.request import pages_for
from kvtier.frontend.served_model import tokenizer, weight_source
from kvtier.frontend.settings import ServeSettings

pytest.importorskip("nixl")
pytestmark = pytest.mark.timeout(300)

KEY = "pd-serve-admin-key-0123456789"
PAGE = 16
SETTINGS = ServeSettings(model="tiny", prefill_instances=1, decode_instances=1,
                         pd_transport="nixl", page_size=PAGE, chunk_tokens=64, device_pages=96,
                         max_new_tokens=32, dtype="fp32", admin_key=KEY)
MODEL = SETTINGS.served_model_name
ADMIN = {"Authorization": f"Bearer {KEY}"}
CLIENT = ServeClient(BASE, MODEL, KEY)
STAGES = {"bootstrap_s", "prefill_s", "transfer_s", "kv_ready_s", "decode_queue_s"}
MESSAGES = [{"role": "system", "content": "You answer from the record book, briefly. " * 3},
            {"role": "user", "content": "What does record 12 say?"}]
sent_bytes: list[int] = []  # every answer's transfer_bytes, in order


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    settings = ServeSettings.from_mapping({**SETTINGS.to_mapping(),
                                           "l3_root": str(tmp_path_factory.mktemp("l3"))})
    with served(settings):
        yield settings


@pytest.fixture(scope="module")
def expected():
    """The tiny model's greedy answer to MESSAGES, computed in this process."""
    tok = tokenizer(SETTINGS)
    prompt = tok.encode_chat(MESSAGES)
    return prompt, in_process_answer(weight_source(SETTINGS), tok, prompt, 12)


def check_pd(kvtier: dict, prompt_tokens: int) -> dict:
    """The `kvtier.pd` field of a handed-off answer, checked; its transfer_bytes noted."""
    pd = kvtier["pd"]
    assert kvtier["instance"] == "pd"
    assert (pd["mode"], pd["transport"]) == ("handoff", "nixl"), pd
    assert (pd["prefill_instance"], pd["decode_instance"]) == ("prefill-0", "decode-0")
    assert set(pd["stages"]) == STAGES
    assert all(v is not None and v >= 0 for v in pd["stages"].values()), pd["stages"]
    assert pd["transfer_pages"] == pages_for(prompt_tokens, PAGE)
    assert pd["transfer_bytes"] > 0 and pd["transfer_bytes"] % pd["transfer_pages"] == 0
    sent_bytes.append(pd["transfer_bytes"])
    return pd


def test_a_chat_answer_is_the_models_and_says_how_it_went(app, expected):
    prompt, text = expected
    body = greedy_chat(MODEL, MESSAGES, 12)
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == 12
    assert body["choices"][0]["message"]["content"] == text
    check_pd(body["kvtier"], len(prompt))
    assert body["kvtier"]["lengths"]["extend_len"] + sum(
        body["kvtier"]["cached_tokens"].values()) == len(prompt)


def test_streaming_gives_the_same_text_and_the_field_last(app, expected):
    prompt, text = expected
    r = requests.post(f"{BASE}/v1/chat/completions", timeout=120, stream=True, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200, r.text
    events = [line[len(b"data: "):] for line in r.iter_lines() if line]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                       if c["choices"])
    assert streamed == text
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
               ) > 1  # token by token, not one piece at the end
    check_pd(chunks[-1]["kvtier"], len(prompt))


def test_a_stop_string_ends_the_answer_early(app, expected):
    """The ingress cancels the stream at a stop string: the request is aborted on the decode
    instance and the deployment has nothing left in flight."""
    _, text = expected
    stop = text[len(text) // 2:][:3]
    body = requests.post(f"{BASE}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": MESSAGES, "max_tokens": 12, "temperature": 0,
        "ignore_eos": True, "stop": [stop]}).json()
    assert body["choices"][0]["message"]["content"] == text[:text.index(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"

    def idle() -> bool:
        assert (load := CLIENT.router()["pd"]["load"]) == 0, f"load {load}"
        return True

    eventually(idle, 30, "nothing was left in flight", retry_on=(AssertionError,),
               interval_s=0.2)


def test_metrics_count_the_stages_and_the_bytes(app):
    from prometheus_client.parser import text_string_to_metric_families

    assert sent_bytes, "run with the answers' tests first"

    def both_instances() -> dict:
        text = requests.get(f"{BASE}/metrics", timeout=30).text
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        instances = {dict(k[1]).get("kvtier_instance") for k in samples}
        # each instance's cache by its name
        assert {"prefill-0", "decode-0"} <= instances, sorted(map(str, instances))
        return samples

    samples = eventually(both_instances, 30, "both instances' snapshots were on /metrics "
                         "(they come every few seconds)", retry_on=(AssertionError,),
                         interval_s=0.5)
    pd = (("kvtier_instance", "pd"), ("transport", "nixl"))
    assert samples[("kvtier_pd_transferred_bytes_total", pd)] >= sum(sent_bytes)
    assert samples[("kvtier_pd_transferred_pages_total", pd)] > 0
    handed = samples[("kvtier_pd_requests_total", (("kvtier_instance", "pd"),
                                                   ("mode", "handoff")))]
    assert handed >= len(sent_bytes)
    for stage in ("bootstrap", "prefill", "transfer", "kv_ready", "decode_queue"):
        key = ("kvtier_pd_stage_seconds_count", (("kvtier_instance", "pd"), ("stage", stage)))
        assert samples[key] >= len(sent_bytes), stage


def test_endpoints_serve_every_instance_or_say_what_pd_lacks(app):
    models = requests.get(f"{BASE}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert requests.get(f"{BASE}/health", timeout=30).status_code == 200
    completion = requests.post(f"{BASE}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "Record 3:", "max_tokens": 4, "temperature": 0})
    assert completion.status_code == 200 and completion.json()["kvtier"]["pd"]["mode"] in {
        "handoff", "mixed"}, completion.text  # a one-page prompt is still handed off
    pin = requests.post(f"{BASE}/admin/pin", headers=ADMIN, timeout=30,
                        json={"tokens": list(range(1, 40))})
    assert pin.status_code == 400 and "--instances" in pin.json()["error"]["message"]
    flushed = requests.post(f"{BASE}/admin/flush", headers=ADMIN, timeout=60).json()
    assert set(flushed["instances"][0]["free_device_pages"]) == {"prefill-0", "decode-0"}
    config = requests.get(f"{BASE}/admin/config", headers=ADMIN, timeout=60).json()
    (shown,) = config["instances"]
    assert (shown["prefill_instances"], shown["decode_instances"], shown["pd_transport"]) == \
        (["prefill-0"], ["decode-0"], "nixl")
    storage = requests.get(f"{BASE}/admin/storage", headers=ADMIN, timeout=30).json()
    assert storage["instances"][0]["l3"]["backend"] == "file"
    off = requests.post(f"{BASE}/admin/storage/detach", headers=ADMIN, timeout=60).json()
    assert off["instances"][0]["l3"] is None
    assert greedy_chat(MODEL, [{"role": "user", "content": "without L3"}], 4)["kvtier"]["pd"]
    on = requests.post(f"{BASE}/admin/storage/attach", headers=ADMIN, timeout=60,
                       json={"backend": "file"})
    assert on.status_code == 200 and on.json()["instances"][0]["l3"]["backend"] == "file"
