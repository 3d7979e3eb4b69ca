"""A vLLM engine with KvtierConnector as a serving instance: an `InstanceServer` drives a
`VllmInstance` (SmolLM2, vLLM's CPU build, L2 only) exactly as it drives kvtier's own
instances. One engine for the module (starting one takes most of a minute here)."""
from __future__ import annotations

import os
import queue
import random
import time

import pytest

from vllm_required import require_vllm

from kvtier.actors.instance_server import InstanceServer, ServerEventKind
from kvtier.engine.request import FinishReason, Resume
from kvtier.engine.sampling import SamplingParams
from kvtier.frontend.cache_events import CacheEventBatch
from kvtier.keys import KeyNamespace
from kvtier.policies import CacheEventKind, CacheTier

require_vllm()

BLOCK = 64
PROMPT = 300  # tokens: four full blocks can be reused ((300 - 1) // 64 = 4)
REUSABLE = (PROMPT - 1) // BLOCK * BLOCK
GREEDY = SamplingParams(max_new_tokens=8, stop_token_ids=())
KEYS = KeyNamespace("smollm2-under-vllm")  # the router's key space for the cache events


@pytest.fixture(scope="module")
def server():
    from kvtier.engine.hf_export import smollm2_hf_dir
    from kvtier.vllm_engine.instance import VllmInstance, VllmSettings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    settings = VllmSettings(str(smollm2_hf_dir()), block_size=BLOCK, kv_cache_bytes=128 << 20,
                            max_model_len=2048, max_num_seqs=4,
                            connector={"hicache_ratio": 2.0})
    srv = InstanceServer(VllmInstance(settings, event_keys=KEYS), "vllm-0")
    try:
        yield srv
    finally:
        srv.close()


def prompt(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(PROMPT)]


def run(server, tokens, sampling=GREEDY, salt="", resume=None, timeout_s=180.0):
    """(each TOKENS event's Progress, the Output) of one request."""
    events: queue.Queue = queue.Queue()
    server.submit(tokens, sampling, events.put, salt, resume)
    progress = []
    deadline = time.monotonic() + timeout_s
    while True:
        event = events.get(timeout=max(0.1, deadline - time.monotonic()))
        if event.kind is ServerEventKind.TOKENS:
            progress.append(event.progress)
        elif event.kind is ServerEventKind.DONE:
            return progress, event.output
        else:
            raise AssertionError(f"the instance stopped serving: {event.message}")


def streamed(progress, start: int = 0) -> list[int]:
    """The tokens streamed, checked to come each once and in order from answer index
    `start` on."""
    out: list[int] = []
    for p in progress:
        assert p.start == start + len(out)
        out.extend(p.tokens)
    return out


def test_a_prompt_again_is_answered_alike_from_l2_then_from_vllms_cache(server):
    tokens = prompt(1)
    progress, cold = run(server, tokens)
    assert cold.finish_reason is FinishReason.LENGTH and len(cold.tokens) == 8
    assert streamed(progress) == list(cold.tokens) and cold.cached.total == 0
    assert cold.lengths.extend_len == PROMPT and cold.ttft_s > 0

    assert server.call(lambda inst: inst.drop_cache()).result(timeout=60)  # L1 gone, L2 kept
    _, from_l2 = run(server, tokens)
    assert from_l2.tokens == cold.tokens
    assert (from_l2.cached.device, from_l2.cached.host, from_l2.cached.storage) \
        == (0, REUSABLE, 0)
    assert from_l2.lengths.host_loaded_length == REUSABLE
    assert from_l2.lengths.extend_len == PROMPT - REUSABLE

    _, from_l1 = run(server, tokens)  # vLLM's prefix cache holds it now
    assert from_l1.tokens == cold.tokens
    assert from_l1.cached.device == REUSABLE and from_l1.cached.host == 0


def test_a_resumed_request_goes_on_after_the_tokens_it_had(server):
    tokens = prompt(2)
    _, whole = run(server, tokens)
    progress, resumed = run(server, tokens, resume=Resume(whole.tokens[:3]))
    assert resumed.tokens == whole.tokens and resumed.prompt == tuple(tokens)
    assert streamed(progress, start=3) == list(whole.tokens[3:])


def test_log_probabilities_are_the_chosen_tokens_and_the_top_ones(server):
    sampling = SamplingParams(max_new_tokens=4, stop_token_ids=(), logprobs=2)
    progress, out = run(server, prompt(3), sampling)
    assert [lp.token for lp in out.logprobs] == list(out.tokens)
    assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token for lp in out.logprobs)  # greedy
    assert [lp for p in progress for lp in p.logprobs] == list(out.logprobs)


def test_a_request_vllm_refuses_fails_alone(server):
    _, refused = run(server, prompt(9) * 8)  # 2,400 tokens: past max_model_len
    assert refused.finish_reason is FinishReason.ERROR and "vLLM refused" in refused.error
    assert refused.tokens == () and server.poll().broken is None
    _, after = run(server, prompt(9))
    assert len(after.tokens) == 8


def test_tenants_never_share_a_prefix(server):
    tokens = prompt(4)
    run(server, tokens, salt="tenant-a")
    _, other = run(server, tokens, salt="tenant-b")
    assert other.cached.total == 0
    _, same = run(server, tokens, salt="tenant-a")
    assert same.cached.total == REUSABLE


def test_a_cancelled_request_is_heard_of_no_more(server):
    events: queue.Queue = queue.Queue()
    request_id = server.submit(prompt(5), SamplingParams(max_new_tokens=500, stop_token_ids=()),
                               events.put)
    assert events.get(timeout=180).kind is ServerEventKind.TOKENS
    server.cancel(request_id)
    deadline = time.monotonic() + 30
    while server.poll().load and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.poll().load == 0 and server.instance.num_pending == 0
    while not events.empty():  # tokens of steps before the cancel, never its end
        assert events.get().kind is ServerEventKind.TOKENS
    _, after = run(server, prompt(6))  # the engine goes on
    assert len(after.tokens) == 8


def events_until(server, keys: list[str], *wanted: tuple[CacheEventKind, CacheTier],
                 timeout_s: float = 30.0):
    """Poll the server's cache events (a maintenance call drains what vLLM published since
    its last step) until `keys` all had each (kind, tier) of `wanted`."""
    seen: dict[tuple, set[str]] = {w: set() for w in wanted}
    deadline = time.monotonic() + timeout_s
    while not all(set(keys) <= got for got in seen.values()):
        assert time.monotonic() < deadline, ", ".join(
            f"{len(got & set(keys))} of {len(keys)} pages {kind.value} in {tier.value}"
            for (kind, tier), got in seen.items())
        server.call(lambda inst: None).result(timeout=30)
        for raw in server.poll().events:
            batch = CacheEventBatch.from_msgpack(raw)
            assert batch.instance == "vllm-0"
            for e in batch.events:
                seen.get((e.kind, e.tier), set()).update(e.page_hashes)
        time.sleep(0.05)


def test_vllms_prefix_cache_reports_its_pages_in_the_routers_key_space(server):
    tokens = prompt(7)
    server.poll()
    run(server, tokens, salt="tenant-e")
    keys = KEYS.page_hashes(tokens, BLOCK, "tenant-e")
    assert len(keys) == PROMPT // BLOCK  # the answer's 8 tokens fill no further block
    # vLLM's prefix cache, and the connector's L2 copies (its take_events), keyed alike
    events_until(server, keys, (CacheEventKind.STORED, CacheTier.DEVICE),
                 (CacheEventKind.STORED, CacheTier.HOST))
    assert server.call(lambda inst: inst.drop_cache()).result(timeout=60)
    run(server, prompt(8))  # vLLM publishes what a reset cleared with its next step
    events_until(server, keys, (CacheEventKind.EVICTED, CacheTier.DEVICE))
