"""`kvtier serve --engine vllm`: the serve graph over two vLLM engines (SmolLM2, vLLM's CPU
build), each with KvtierConnector as its L2 and the graph's file L3. Routing follows the
instance that holds a prompt in vLLM's prefix cache, then in the connector's L2 once that is
flushed; a document computed on one instance is read from L3 on the other, with the answer
of the cold run; tenants never share a prefix. One graph for the module (two engines take
most of two minutes to start here)."""
from __future__ import annotations

import random
import threading

import pytest

from eventually import eventually
from http_client import ServeClient
from openai_checks import (greedy_logprobs_are_sorted_with_the_chosen_first,
                           n_answers_equal_single_requests)
from vllm_required import require_vllm

from kvtier.frontend.settings import ServeSettings

require_vllm()
pytestmark = pytest.mark.timeout(900)

PORT = 8139
BLOCK = 64
PROMPT = 300  # tokens: four full blocks can be reused ((300 - 1) // 64 = 4)
REUSABLE = (PROMPT - 1) // BLOCK * BLOCK
KEY = "serve-vllm-admin-key-0123456789"
TENANTS = {"key-of-a": "tenant-a", "key-of-b": "tenant-b"}
DTYPES = ("bfloat16", "float16", "float32")  # what vLLM resolves on CPUs and GPUs
# the holder's long answer while another question comes: seconds of decoding, so that it is
# still running when the router has seen it busy and routes the question (96 tokens ended
# first once, on a quiet machine: the question then went to the idle-again holder)
BUSY_TOKENS = 384


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    from kvtier.actors import serve_graph

    settings = ServeSettings(engine="vllm", instances=2, page_size=BLOCK, device_pages=48,
                             hicache_ratio=2.0, max_new_tokens=BUSY_TOKENS, admin_key=KEY,
                             api_keys=TENANTS, l3_root=str(tmp_path_factory.mktemp("l3")),
                             hicache={"prefetch_policy": "wait_complete"},
                             # a vLLM step on two loaded cores can take seconds, and on a
                             # CPU that emulates bf16 (AVX2 only) a prefill here took tens of
                             # seconds: a request moved to the other instance then hits what
                             # its own first run wrote (`kvtier.moves` says so), which is not
                             # what these tests ask. No test here stalls an instance.
                             stall_timeout_s=240.0)
    try:
        serve_graph.start(settings, port=PORT)
        yield ServeClient(f"http://127.0.0.1:{PORT}", settings.served_model_name, KEY,
                          timeout_s=300)
    finally:
        serve_graph.stop()


def document(seed: int, length: int = PROMPT) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def ask(app: ServeClient, tokens: list[int], key: str = "key-of-a", max_tokens: int = 8,
        **fields) -> dict:
    """A greedy completion of the token prompt: its JSON body (served where it was routed:
    an answer moved to another instance would hit what its first run computed)."""
    body = app.complete(tokens, max_tokens=max_tokens, key=key, **fields)
    assert body["kvtier"]["moves"] == 0, body["kvtier"]
    return body


def cached(**tiers: int) -> dict:
    """An answer's `kvtier.cached_tokens`: these tiers' tokens, the others' 0."""
    return {"device": 0, "host": 0, "storage": 0, "peer": 0, **tiers}


def settled(app: ServeClient, holder: str, timeout_s: float = 30.0) -> dict:
    """Until the router saw every instance idle and `holder` holding pages (it learns both
    by polling): the router's view then."""
    def idle() -> dict | None:
        shown = app.router()
        quiet = all(i["load"] == 0 for i in shown.values()) and shown[holder]["indexed_pages"]
        return shown if quiet else None

    return eventually(idle, timeout_s, "the router saw every instance idle", interval_s=0.1)


def metrics_moved() -> None:
    """kvtier's /metrics counted the vLLM instances' cache in kvtier's own families: hits by
    tier, L2 loads and backups with their bytes, L3 hits."""
    import requests
    from prometheus_client.parser import text_string_to_metric_families

    def moved() -> dict:
        text = requests.get(f"http://127.0.0.1:{PORT}/metrics", timeout=30).text
        sums: dict = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = (family.name, sample.labels.get("tier", ""))
                    sums[key] = sums.get(key, 0.0) + sample.value
        wanted = [("kvtier_hit_tokens", "device"), ("kvtier_hit_tokens", "host"),
                  ("kvtier_hit_tokens", "storage"), ("kvtier_load_back_tokens", ""),
                  ("kvtier_load_back_bytes", ""), ("kvtier_backup_tokens", ""),
                  ("kvtier_backup_bytes", ""), ("kvtier_lookups", ""),
                  ("kvtier_prefetch_hit_tokens", "")]
        still = [w for w in wanted if sums.get(w, 0) <= 0]
        assert not still, f"not moved: {still}"
        return sums

    sums = eventually(moved, 30, "kvtier's cache families moved", retry_on=(AssertionError,),
                      interval_s=0.5)
    # the connector loaded at least what the answers say it supplied
    assert sums[("kvtier_hit_tokens", "host")] + sums[("kvtier_hit_tokens", "storage")] <= \
        sums[("kvtier_load_back_tokens", "")]


def test_routing_follows_l1_then_l2_and_l3_carries_a_document_across(app):
    doc = document(1)
    cold = ask(app, doc)
    holder = cold["kvtier"]["instance"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    settled(app, holder)

    again = ask(app, doc)  # vLLM's prefix cache holds it: the same instance, an L1 hit
    assert again["kvtier"]["instance"] == holder, again["kvtier"]["route"]
    assert again["kvtier"]["cached_tokens"] == cached(device=REUSABLE)
    assert again["choices"][0]["text"] == cold["choices"][0]["text"]

    settled(app, holder)
    flushed = app.flush()["instances"]
    assert all(f["free_device_pages"] > 0 for f in flushed)
    from_l2 = ask(app, doc)  # L1 dropped, the connector's L2 kept it
    assert from_l2["kvtier"]["instance"] == holder, from_l2["kvtier"]["route"]
    assert from_l2["kvtier"]["cached_tokens"] == cached(host=REUSABLE)
    assert from_l2["choices"][0]["text"] == cold["choices"][0]["text"]

    # once the router knows the document's pages are in L3 (the holder's connector wrote
    # them), the holder busy with a long answer over it: the other instance is as cheap and
    # idle, takes the question and reads the document from L3
    settled(app, holder)
    eventually(lambda: app.get("/admin/router", admin=True).json()["storage_pages"]
               >= REUSABLE // BLOCK, 60, "the router learns the document's pages are in L3",
               interval_s=0.05)
    answered: list[dict] = []
    busy = threading.Thread(target=lambda: answered.append(
        ask(app, doc + [7], max_tokens=BUSY_TOKENS, ignore_eos=True)))
    busy.start()
    try:
        eventually(lambda: app.router()[holder]["load"] >= 1, 60, "the holder busy",
                   interval_s=0.05)
        seen = app.router()  # what the router knew just before (said if the route is wrong)
        other = ask(app, doc)
    finally:
        busy.join()
    assert answered[0]["kvtier"]["instance"] == holder
    assert other["kvtier"]["instance"] != holder, (other["kvtier"]["route"], seen,
                                                   answered[0]["kvtier"]["route"])
    assert other["kvtier"]["cached_tokens"] == cached(storage=REUSABLE)
    assert other["choices"][0]["text"] == cold["choices"][0]["text"]
    metrics_moved()  # the three tiers' hits, in kvtier's own metrics


TENANT_ROUNDS = 20


def test_tenants_never_share_a_prefix(app):
    """20 documents: tenant A asks each twice (the second a hit of its own), then tenant B
    asks it: B is told 0 cached tokens, from any tier, and answers as A did. Every fourth
    round L1 is flushed before B asks, so B's engine looks in L2 and L3 too (where A's pages
    are, under A's keys)."""
    shared = []
    for round_ in range(TENANT_ROUNDS):
        doc = document(100 + round_, length=BLOCK * 3 + 5)
        first = ask(app, doc, key="key-of-a", max_tokens=2)
        own = ask(app, doc, key="key-of-a", max_tokens=2)
        assert own["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, own["kvtier"]
        if round_ % 4 == 3:
            settled(app, own["kvtier"]["instance"])
            app.flush()
        theirs = ask(app, doc, key="key-of-b", max_tokens=2)
        if theirs["usage"]["prompt_tokens_details"]["cached_tokens"] != 0 or \
                theirs["choices"][0]["text"] != first["choices"][0]["text"]:
            shared.append((round_, theirs["kvtier"], theirs["choices"][0]["text"],
                           first["choices"][0]["text"]))
    assert shared == []


def test_n_answers_and_logprobs_come_back_as_from_kvtiers_own_instances(app):
    """n=3 over a vLLM instance: three answers sampled with seeds s, s+1, s+2 (answer i is
    the single request with seed s+i), the prompt counted once. Log-probabilities: one entry
    per answer token, the chosen token the most likely under greedy decoding, top-k sorted."""
    openai = pytest.importorskip("openai")
    # a 503 ("no instance can serve the request now", an instance seen as stalled on a
    # loaded machine) says to retry: the client does, as OpenAI's clients do by default
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{PORT}/v1", api_key="key-of-a",
                           max_retries=3, timeout=300)
    model = app.model
    messages = [{"role": "user", "content": "Name three rivers and one lake."}]
    kw = dict(model=model, messages=messages, max_tokens=6, temperature=1.0)
    n_answers_equal_single_requests(client, 11, **kw)
    greedy = client.chat.completions.create(**{**kw, "temperature": 0}, logprobs=True,
                                            top_logprobs=3)
    greedy_logprobs_are_sorted_with_the_chosen_first(greedy, 3)


def test_the_admin_api_says_what_a_vllm_instance_runs_and_lacks(app):
    config = app.get("/admin/config", admin=True).json()["instances"]
    assert [c["engine"] for c in config] == ["vllm", "vllm"]
    assert all(c["l3"] == "file" and c["device_pages"] >= 48 and c["dtype"] in DTYPES
               and c["host_pages"] == 2 * c["device_pages"] for c in config)
    # each step computes at most the deployment's chunk, admitted hit-first
    assert all(c["schedule_policy"] == "hit_first" and c["chunk_tokens"] == 512  # the default
               for c in config)
    pin = app.post("/admin/pin", {"tokens": document(3)}, admin=True)
    assert pin.status_code == 400 and "engine vllm" in pin.text
    attach = app.post("/admin/storage/attach", {"backend": "file"}, admin=True)
    assert attach.status_code == 400 and "engine vllm" in attach.text
    assert app.get("/health").json()["status"] == "ok"


def test_a_router_that_starts_again_rebuilds_its_index_from_the_instances(app):
    """The router's replica killed: Serve starts another, whose first polls ask each
    instance what it holds, so a known document still goes to its holder."""
    import ray

    doc = document(4)
    holder = ask(app, doc)["kvtier"]["instance"]
    settled(app, holder)
    (router,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if "RouterDeployment" in a["name"]]
    ray.kill(ray.get_actor(router["name"], namespace=router["namespace"]), no_restart=True)
    # until the new router answers and indexed the instances' holdings
    eventually(lambda: app.router()[holder]["indexed_pages"] > 0, 120,
               "a router came back with the instances' pages",
               retry_on=(AssertionError, OSError), interval_s=0.5)
    again = ask(app, doc)
    assert again["kvtier"]["instance"] == holder, again["kvtier"]["route"]
    assert again["kvtier"]["cached_tokens"]["device"] == REUSABLE


def test_an_instance_killed_mid_answer_is_routed_around_and_its_answer_goes_on(app):
    """The replica of the instance streaming an answer dies (its vLLM engine with it): the
    answer goes on on the other instance after the tokens already sent, each token once,
    equal to the answer that ran through; the next requests avoid the dead instance until
    Serve replaces it. Last in the module: the graph has a new instance after it."""
    import json

    import ray

    doc = document(5)
    long = {"max_tokens": 48, "ignore_eos": True}
    whole = ask(app, doc, **long)
    holder = whole["kvtier"]["instance"]
    settled(app, holder)
    (victim,) = [a for a in ray.util.list_named_actors(all_namespaces=True)
                 if f"#{holder}#" in a["name"]]
    r = app.post("/v1/completions", {"model": app.model, "prompt": doc, "temperature": 0,
                                     "stream": True, **long}, key="key-of-a", stream=True)
    assert r.status_code == 200, r.text
    texts, killed = [], False
    for line in r.iter_lines():
        if not line or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[len(b"data: "):])
        assert "error" not in chunk, chunk
        texts += [c["text"] for c in chunk["choices"]]
        if not killed and len(texts) >= 4:  # some tokens out: the holder dies now
            ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]),
                     no_restart=True)
            killed = True
    assert killed and "".join(texts) == whole["choices"][0]["text"]
    after = ask(app, doc)
    # the dead replica took nothing; Serve may have replaced it by now (a new replica under
    # the instance's name: once, in a loaded run, before this question came)
    replacements = [a for a in ray.util.list_named_actors(all_namespaces=True)
                    if f"#{holder}#" in a["name"] and a["name"] != victim["name"]]
    assert after["kvtier"]["instance"] != holder or replacements, after["kvtier"]["route"]
