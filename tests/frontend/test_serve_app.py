"""The serve graph for real: a local Ray cluster, Serve on 127.0.0.1, two instances of the
tiny model (random weights over SmolLM2's vocabulary) sharing a file L3, and HTTP requests."""
from __future__ import annotations

import concurrent.futures
import json
import random

import pytest
import requests
from eventually import eventually
from http_client import ServeClient
from openai_checks import (greedy_logprobs_are_sorted_with_the_chosen_first,
                           n_answers_equal_single_requests)
from shared_serve import BASE, served

from kvtier.netcheck import listening
from kvtier.frontend.settings import ServeSettings

KEY = "test-admin-key-0123456789"
SETTINGS = ServeSettings(model="tiny", instances=2, page_size=16, chunk_tokens=64,
                         device_pages=96, max_new_tokens=32, dtype="fp32", admin_key=KEY)
MODEL = SETTINGS.served_model_name
ADMIN = {"Authorization": f"Bearer {KEY}"}
CLIENT = ServeClient(BASE, MODEL, KEY)
SYSTEM = ("You are a careful assistant for the kvtier project. Answer briefly and cite the "
          "record number. " * 4)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def app():
    with served(SETTINGS) as pids:  # every process of the cluster it runs on
        yield pids


def wait_indexed(instance: str, pages: int) -> None:
    """Until the router has heard of `pages` pages on `instance` (events arrive by polling)."""
    def indexed() -> bool:
        status = CLIENT.router()
        assert status[instance]["indexed_pages"] >= pages, status
        return True

    eventually(indexed, 30, f"the router indexed {pages} pages on {instance}",
               retry_on=(AssertionError,), interval_s=0.1)


def test_models_health_and_loopback(app):
    models = requests.get(f"{BASE}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    health = requests.get(f"{BASE}/health", timeout=30)
    assert health.status_code == 200 and health.json()["instances"] == 2
    found = {l.host for l in listening(app)}
    assert found and found <= {"127.0.0.1", "::1"}, found


def test_completion_and_cached_tokens_rise_on_the_second_turn(app):
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Record 7?"}]
    first = CLIENT.chat(turn1)
    assert first["object"] == "chat.completion"
    answer = first["choices"][0]["message"]["content"]
    assert first["usage"]["completion_tokens"] == 8
    assert first["choices"][0]["finish_reason"] == "length"
    turn2 = turn1 + [{"role": "assistant", "content": answer},
                     {"role": "user", "content": "And record 9?"}]
    wait_indexed(first["kvtier"]["instance"], 1)
    second = CLIENT.chat(turn2)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > first["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == sum(second["kvtier"]["cached_tokens"].values()) > 0
    assert second["kvtier"]["instance"] == first["kvtier"]["instance"]  # routed to the holder
    lengths = second["kvtier"]["lengths"]
    assert lengths["extend_len"] == second["usage"]["prompt_tokens"] - cached


def test_streaming_gives_the_same_text_as_a_plain_request(app):
    body = {"model": MODEL, "prompt": SYSTEM + " Record 11?", "max_tokens": 10,
            "temperature": 0}
    plain = requests.post(f"{BASE}/v1/completions", json=body, timeout=120).json()
    r = requests.post(f"{BASE}/v1/completions", timeout=120, stream=True,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len(b"data: "):] for line in r.iter_lines() if line]
    assert events[-1] == b"[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == plain["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 10 and "kvtier" in chunks[-1]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_chat_streaming_opens_with_the_role(app):
    r = requests.post(f"{BASE}/v1/chat/completions", timeout=120, stream=True,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 4, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != b"data: [DONE]"]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,status,needle", [
    (b"{not json", 400, "JSON"),
    (b"[1, 2]", 400, "object"),
    (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "gpt-9"),
    (json.dumps({"model": MODEL, "prompt": ""}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "x " * 6000}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": [1, 2, 10**8]}).encode(), 400, "prompt"),
    (json.dumps({"model": MODEL, "prompt": "x", "temperature": -1}).encode(), 400,
     "temperature"),
    (json.dumps({"model": MODEL, "prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 10**6}).encode(), 400,
     "max_tokens"),
    (json.dumps({"model": MODEL, "prompt": "x", "n": 17}).encode(), 400, "n"),
    (b"{" + b" " * (2 << 20) + b"}", 413, "bytes"),
])
def test_bad_requests_get_a_4xx_with_a_message(app, body, status, needle):
    r = requests.post(f"{BASE}/v1/completions", data=body, timeout=60,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == status, r.text
    message = r.json()["error"]["message"]
    assert needle in message, message


def test_admin_endpoints_need_the_key(app):
    for headers in ({}, {"Authorization": "Bearer wrong-key-wrong-key"}, {"Authorization": KEY}):
        r = requests.post(f"{BASE}/admin/flush", headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        assert requests.get(f"{BASE}/admin/storage", headers=headers,
                            timeout=30).status_code == 401
    flushed = requests.post(f"{BASE}/admin/flush", headers=ADMIN, timeout=60).json()
    assert len(flushed.get("instances", ())) == 2, flushed
    shown = requests.get(f"{BASE}/admin/storage", headers=ADMIN, timeout=30).json()
    assert {i["l3"]["backend"] for i in shown["instances"]} == {"file"}


def namespace_stats(ns: str):
    """The L3 namespace's directory figures, asked of its actor (this process is the driver)."""
    import ray

    from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE, NamespaceClient

    return NamespaceClient(ray.get_actor(SETTINGS.l3_actor, namespace=RAY_NAMESPACE)).stats(ns)


def wait_for(what: str, check, ns: str, poke=None):
    """Poll the namespace's stats until `check(stats)` (30 s hang guard); `poke` between."""
    def checked():
        stats = namespace_stats(ns)
        if check(stats):
            return stats
        if poke is not None:
            poke()
        raise AssertionError(stats)

    return eventually(checked, 30, what, retry_on=(AssertionError,), interval_s=0.2)


def test_admin_purge_empties_the_namespace_and_ranks_back_up_again(app):
    assert requests.post(f"{BASE}/admin/purge", timeout=30).status_code == 401
    shown = requests.get(f"{BASE}/admin/storage", headers=ADMIN, timeout=30).json()
    ns = shown["instances"][0]["l3"]["namespace"]
    ask = [{"role": "user", "content": SYSTEM + " Record 21?"}]
    held = wait_for("pages reach L3", lambda s: s.published_pages > 0, ns, lambda: CLIENT.chat(ask))
    r = requests.post(f"{BASE}/admin/purge", headers=ADMIN, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["namespace"] == ns and r.json()["purged_pages"] >= held.published_pages
    after = namespace_stats(ns)
    assert after.epoch == held.epoch + 1
    assert after.purged_pages - held.purged_pages == r.json()["purged_pages"]
    wait_for("the purge's deletes run", lambda s: s.doomed_pages == 0, ns)
    # the ranks follow the new epoch at their next steps: they forget what L3 held and
    # write their L2 pages again, so the namespace fills up again
    wait_for("ranks back up again", lambda s: s.published_pages > 0, ns, lambda: CLIENT.chat(ask))


def test_the_namespace_directory_lists_the_l2_pages_of_each_instance(app):
    """An instance tells the L3 namespace's directory what its L2 holds (its cache events):
    a prompt's pages are listed under the instance that computed them; detached from L3 it
    is listed no more."""
    import ray

    from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE, NamespaceClient

    shown = requests.get(f"{BASE}/admin/storage", headers=ADMIN, timeout=30).json()
    ns = shown["instances"][0]["l3"]["namespace"]
    client = NamespaceClient(ray.get_actor(SETTINGS.l3_actor, namespace=RAY_NAMESPACE))
    tokens = [random.Random(31).randrange(100, 40000) for _ in range(5 * 16 + 3)]
    hashes = client.info(ns).spec.key_namespace.page_hashes(tokens, 16)
    answered = {CLIENT.complete(tokens)["kvtier"]["instance"]}

    def listed():
        found = client.l2_holders(ns, hashes)
        if found and found[0].holder in answered and found[0].pages == len(hashes):
            return found
        # a page may reach L2 once it was hit (the write policy)
        answered.add(CLIENT.complete(tokens)["kvtier"]["instance"])
        raise AssertionError(found)

    eventually(listed, 30, "the prompt's L2 pages listed under an instance that answered it",
               retry_on=(AssertionError,), interval_s=0.3)
    assert namespace_stats(ns).l2_holders >= 1


def test_admin_detach_and_attach(app):
    bad = requests.post(f"{BASE}/admin/storage/attach", headers=ADMIN, timeout=30,
                        json={"backend": "floppy"})
    assert bad.status_code == 400 and "floppy" in bad.json()["error"]["message"]
    missing = requests.post(f"{BASE}/admin/storage/attach", headers=ADMIN, timeout=30, json={})
    assert missing.status_code == 400
    twice = requests.post(f"{BASE}/admin/storage/attach", headers=ADMIN, timeout=60,
                          json={"backend": "file"})
    assert twice.status_code == 400 and "detach it first" in twice.json()["error"]["message"]
    shown = requests.get(f"{BASE}/admin/storage", headers=ADMIN, timeout=30).json()
    ns = shown["instances"][0]["l3"]["namespace"]
    off = requests.post(f"{BASE}/admin/storage/detach", headers=ADMIN, timeout=60).json()
    assert [i["l3"] for i in off["instances"]] == [None, None]
    assert namespace_stats(ns).l2_holders == 0  # detached: no instance is listed
    CLIENT.chat([{"role": "user", "content": "served without L3"}])
    on = requests.post(f"{BASE}/admin/storage/attach", headers=ADMIN, timeout=60,
                       json={"backend": "file"})
    assert on.status_code == 200, on.text
    assert {i["l3"]["backend"] for i in on.json()["instances"]} == {"file"}
    assert on.json()["instances"][0]["l3"]["namespace"] == ns
    wait_for("the L2 listings come back", lambda s: s.l2_holders >= 1, ns)


def test_32_concurrent_requests_are_all_answered(app):
    def one(i: int) -> dict:
        return CLIENT.chat([{"role": "user", "content": f"Question {i}: what is record {i}?"}],
                    max_tokens=6)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        outs = list(pool.map(one, range(32)))
    assert len(outs) == 32
    assert all(o["usage"]["completion_tokens"] == 6 for o in outs)
    assert {o["kvtier"]["instance"] for o in outs} == {"instance-0", "instance-1"}


def test_follow_ups_go_to_their_holder_and_load_still_spreads(app):
    requests.post(f"{BASE}/admin/flush", headers=ADMIN, timeout=60)
    homes = {}
    for c in range(4):  # four conversations, each follow-up where its first turn went
        turn1 = [{"role": "system", "content": f"Conversation {c}. " + SYSTEM},
                 {"role": "user", "content": "Start."}]
        first = CLIENT.chat(turn1)
        wait_indexed(first["kvtier"]["instance"], 1)
        turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"][
            "content"]}, {"role": "user", "content": "Go on."}]
        second = CLIENT.chat(turn2)
        assert second["kvtier"]["instance"] == first["kvtier"]["instance"], \
            (second["kvtier"], CLIENT.router())
        homes[c] = first["kvtier"]["instance"]

    # Everyone asks about one shared document at once: the holder fills up and the rest
    # spill over, so both instances serve (and then both hold the prefix).
    doc = [{"role": "system", "content": "Shared document. " + SYSTEM}]

    def ask(i: int) -> str:
        out = CLIENT.chat(doc + [{"role": "user", "content": f"Point {i}?"}], max_tokens=16)
        return out["kvtier"]["instance"]

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        served = list(pool.map(ask, range(12)))
    assert set(served) == {"instance-0", "instance-1"}, served


def test_metrics_show_every_family(app):
    from prometheus_client.parser import text_string_to_metric_families

    from kvtier.frontend.metrics import (COUNTERS, GAUGES, HISTOGRAMS, NAMESPACE_COUNTERS,
                                         NAMESPACE_GAUGES)

    for ask in ("Metrics?", "Metrics!", "Metrics."):  # two instances: one of them hits
        CLIENT.chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": ask}])
    wanted = {f"kvtier_{n}" for n in {*COUNTERS, *GAUGES, *HISTOGRAMS}}
    namespaced = {f"kvtier_{n}" for n in {*NAMESPACE_COUNTERS, *NAMESPACE_GAUGES}}
    # What real traffic moves (the rest count faults and refusals, or the agreement rounds
    # of TP > 1: present, at 0 here).
    moved = {"kvtier_cached_tokens", "kvtier_requests", "kvtier_prompt_tokens",
             "kvtier_generation_tokens", "kvtier_lookups", "kvtier_hit_tokens",
             "kvtier_backup_tokens", "kvtier_backup_bytes", "kvtier_backup_seconds",
             "kvtier_storage_backup_tokens", "kvtier_storage_write_bytes",
             "kvtier_prefetch_query_tokens", "kvtier_ttft_seconds", "kvtier_tpot_seconds",
             "kvtier_e2e_request_seconds", "kvtier_queue_seconds",
             "kvtier_storage_write_bandwidth_bytes_per_second", "kvtier_host_used_tokens",
             "kvtier_host_total_tokens", "kvtier_device_used_tokens",
             "kvtier_device_total_tokens"}

    def total(fam) -> float:
        return sum(s.value for s in fam.samples if not s.name.endswith("_created")
                   and not s.name.endswith("_bucket"))

    def every_family() -> dict:
        text = requests.get(f"{BASE}/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        still = sorted((wanted - set(families)) | (namespaced - set(families)) |
                       {n for n in moved if n in families and total(families[n]) <= 0})
        assert not still, f"missing or unmoved: {still}"
        return families

    # instance snapshots are taken every few seconds
    families = eventually(every_family, 30, "every family was on /metrics and had moved",
                          retry_on=(AssertionError,), interval_s=0.5)
    assert all(f.startswith("kvtier_") for f in families)
    labels = {s.labels.get("kvtier_instance") for f in families.values() for s in f.samples
              if f.name.removesuffix("_created") not in namespaced}
    assert labels <= {"instance-0", "instance-1"}  # never Prometheus' own `instance` label
    spaces = {s.labels.get("namespace") for n in namespaced for s in families[n].samples}
    assert len(spaces) == 1 and None not in spaces  # the one L3 namespace both instances share
    assert not any("instance" in s.labels for f in families.values() for s in f.samples)


def test_the_openai_client_reads_every_answer(app):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "SDK?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                           temperature=0, extra_body={"top_k": 4})
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens >= 1
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content  # greedy: the same answer
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens is not None
    comp = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4,
                                     temperature=0)
    assert comp.choices[0].finish_reason in ("stop", "length")
    assert [m.id for m in client.models.list()] == [MODEL]


def test_n_answers_come_back_indexed_and_equal_single_requests(app):
    """n=3: three answers sampled with seeds s, s+1, s+2 (answer i equals a single request
    with seed s+i); the prompt counted once; streamed, every chunk names its answer."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "n?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=1.0)
    many = n_answers_equal_single_requests(client, 11, **kw)
    chunks = list(client.chat.completions.create(n=2, seed=11, stream=True, **kw))
    texts, ends = ["", ""], [None, None]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            ends[choice.index] = choice.finish_reason or ends[choice.index]
    assert texts == [c.message.content for c in many.choices[:2]]
    assert all(e in ("stop", "length") for e in ends)
    comp = client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=3, n=2,
                                     temperature=0)
    assert [c.index for c in comp.choices] == [0, 1] and comp.choices[0].text == comp.choices[1].text


def test_logprobs_come_with_every_answer_token(app):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{BASE}/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "lp?"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=6, temperature=0, logprobs=True,
              top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    content = greedy_logprobs_are_sorted_with_the_chosen_first(whole, 3)
    joined = b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace")
    assert joined.startswith(whole.choices[0].message.content)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    # the same tokens; the logprobs within float noise (the second run hits the first's
    # cached prompt, so its prefill ran other forwards: default mode is not bit-exact)
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content],
                                                          abs=1e-3)
    plain = client.chat.completions.create(**{**kw, "logprobs": None, "top_logprobs": None})
    assert plain.choices[0].logprobs is None
    comp = client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=4, temperature=0,
                                     logprobs=2)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(top) <= 2 and max(top.values()) == p
               for top, p in zip(lp.top_logprobs, lp.token_logprobs))
