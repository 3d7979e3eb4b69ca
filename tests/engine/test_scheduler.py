"""The scheduler through the Engine: budget, prefetch finalization, L1-full admission,
continuous batching, preemption, abort at every stage, and the five lengths."""
from __future__ import annotations

import pytest
import torch
from cache_builder import build_cache
from eventually import eventually

from kvtier.engine import Engine, FinishReason, Output, RequestState, SamplingParams
from kvtier.errors import ConfigError
from kvtier.tiers.hierarchical_cache import HierarchicalCache

PAGE = 16


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_cache(model, device_pages: int = 64, l3_dir=None, page: int = PAGE,
               deterministic: bool = False) -> HierarchicalCache:
    knobs = {"page_size": page, "hicache_ratio": 4.0, "load_back_threshold_tokens": page}
    if l3_dir is not None:
        knobs.update(storage_backend="file", storage_options={"root_dir": str(l3_dir)},
                     prefetch_policy="wait_complete", prefetch_threshold_tokens=page)
    return build_cache(model.kv_spec(page), device_pages, model="tiny",
                       deterministic=deterministic, **knobs)


def engine(model, cache: HierarchicalCache, **kw) -> Engine:
    return Engine(model, cache, owns_cache=True, **kw)


def assert_no_leaks(cache: HierarchicalCache) -> None:
    """After every request ended: L1/L2 hold only the tree's pages, nothing locked/protected."""
    cache.flush()
    if cache.storage is not None:
        cache.storage.drain()
    nodes = cache.tree.nodes()
    assert not [n for n in nodes if n.lock_ref or n.host_ref]
    device = sorted(p for n in nodes if n.value is not None for p in n.value)
    host = sorted(p for n in nodes if n.host_value is not None for p in n.host_value)
    assert cache.device_pool.allocator.allocated_pages() == device
    assert cache.host_pool.allocator.allocated_pages() == host


def check_lengths(out: Output) -> None:
    n = out.lengths
    assert n.prefix_len + n.host_loaded_length + n.extend_len == len(out.prompt)
    assert n.storage_hit_length <= n.host_loaded_length
    assert out.cached.total == len(out.prompt) - n.extend_len
    assert out.cached.storage == n.storage_hit_length and out.cached.device == n.prefix_len


def run_all(eng: Engine, max_steps: int = 10_000) -> list[Output]:
    outs: list[Output] = []
    for _ in range(max_steps):
        if not eng.has_unfinished:
            return outs
        outs += eng.step()
    raise AssertionError("the engine did not finish its requests")


GREEDY = SamplingParams(max_new_tokens=12)


def test_continuous_batching_equals_one_at_a_time(tiny_models) -> None:
    model = tiny_models[torch.float32]
    doc = toks(40, 1)
    prompts = [doc + toks(7, 2), toks(23, 3), doc + toks(30, 4), toks(70, 5)]
    stop = SamplingParams(max_new_tokens=30, stop_token_ids=(5, 17))
    seeded = SamplingParams(max_new_tokens=9, temperature=0.8, top_p=0.9, seed=7)
    params = [GREEDY, stop, seeded, SamplingParams(max_new_tokens=20)]
    with engine(model, make_cache(model)) as eng:
        batched = eng.generate(prompts, params)
        assert_no_leaks(eng.cache)
    with engine(model, make_cache(model)) as eng:
        single = [eng.generate([p], s)[0] for p, s in zip(prompts, params)]
    for b, s, p in zip(batched, single, params):
        assert b.tokens == s.tokens
        assert len(b.tokens) == p.max_new_tokens or b.finish_reason is FinishReason.STOP
        assert b.ttft_s is not None and b.ttft_s > 0
        check_lengths(b), check_lengths(s)
    assert single[2].cached.device == 32  # doc's whole pages, hit from request 0


def test_token_budget_counts_load_back_and_prefill(tiny_models) -> None:
    model = tiny_models[torch.float32]
    doc = toks(32, 10)
    with engine(model, make_cache(model), token_budget=64) as eng:
        eng.generate([doc + toks(5, 11)], GREEDY)
        eng.cache.flush()
        eng.cache.evict_device(10**9)  # doc now in L2 only
        for prompt in (doc + toks(9, 12), toks(150, 13), toks(40, 14), doc + toks(20, 15)):
            eng.add_request(prompt, GREEDY)
        steps, outs = [], []
        while eng.has_unfinished:
            outs += eng.step()
            steps.append(eng.last_step)
        assert all(s.budget_tokens <= 64 for s in steps), steps
        assert any(s.loaded_tokens and s.prefill_tokens for s in steps)
        assert sum(s.prefill_tokens > 0 for s in steps) >= 4  # the 150-token prompt is chunked
        assert {o.cached.host for o in outs} >= {32}
        for o in outs:
            check_lengths(o)
        assert_no_leaks(eng.cache)


def test_a_load_larger_than_the_budget_runs_alone_instead_of_recomputing(tiny_models) -> None:
    model = tiny_models[torch.float32]
    doc = toks(96, 20)
    with engine(model, make_cache(model), token_budget=32, deterministic=True) as eng:
        cold = eng.generate([doc + toks(3, 21)], GREEDY)[0]
        eng.cache.flush()
        eng.cache.evict_device(10**9)
        eng.add_request(doc + toks(3, 21), GREEDY)
        (hit,) = run_all(eng)
        assert hit.cached.host == 96 and hit.tokens == cold.tokens
        assert torch.equal(hit.prefill_logits, cold.prefill_logits)


def test_prefetch_is_finalized_for_every_waiting_request(tiny_models, tmp_path) -> None:
    model = tiny_models[torch.float32]
    prompts = [toks(64, 30 + i) + toks(5, 40 + i) for i in range(3)]
    with engine(model, make_cache(model, l3_dir=tmp_path)) as eng:
        first = eng.generate(prompts, GREEDY)
        eng.cache.flush()
    with engine(model, make_cache(model, l3_dir=tmp_path), token_budget=PAGE) as eng:
        ids = [eng.add_request(p, GREEDY) for p in prompts]
        waiting = list(eng.scheduler.waiting)
        assert all(r.ticket is not None for r in waiting)
        eventually(lambda: all(eng.cache.prefetch_ready(r.ticket) for r in waiting), 30,
                   "every waiting request's prefetch was ready", interval_s=0.001)
        eng.step()
        assert eng.last_step.admitted == 1  # the budget stops the scan after the first
        assert [r.state for r in waiting[1:]] == [RequestState.WAITING] * 2
        assert all(r.ticket is None and r.storage_hit == 64 for r in waiting)
        outs = {o.request_id: o for o in run_all(eng)}
        for i, f in zip(ids, first):
            assert outs[i].tokens == f.tokens and outs[i].cached.storage == 64
            check_lengths(outs[i])
        assert_no_leaks(eng.cache)


def test_admission_stops_cleanly_when_l1_is_full(tiny_models) -> None:
    model = tiny_models[torch.float32]
    prompts = [toks(60, 50 + i) for i in range(4)]  # 4 pages each
    params = SamplingParams(max_new_tokens=20)
    with engine(model, make_cache(model)) as eng:
        reference = [eng.generate([p], params)[0].tokens for p in prompts]
    with engine(model, make_cache(model, device_pages=13)) as eng:
        # preemption (recompute) is what this test checks; test_retraction the retraction
        # that otherwise keeps a pushed-out request's KV in L2
        eng.scheduler.retraction.enabled = False
        for p in prompts:
            eng.add_request(p, params)
        eng.step()
        sched = eng.scheduler
        assert eng.last_step.admitted == 3 and len(sched.waiting) == 1
        assert sched.waiting[0].lookup is None and not sched.waiting[0].pages
        held = {p for r in sched.running for p in r.own_pages}  # committed ones: tree's too
        tree = [p for n in eng.cache.tree.nodes() if n.value for p in n.value]
        assert len(tree) == len(set(tree))
        assert eng.cache.device_pool.allocator.allocated_pages() == sorted(held | set(tree))
        outs, preempted = [], 0
        while eng.has_unfinished:
            outs += eng.step()
            preempted += eng.last_step.preempted
        assert preempted  # three decoding sequences outgrow 13 pages
        outs.sort(key=lambda o: o.request_id)
        # queue time: arrival to first admission (a preempted restart keeps it), within TTFT
        assert all(0 <= o.queue_s <= o.ttft_s for o in outs)
        assert outs[3].queue_s > max(o.queue_s for o in outs[:3])  # it waited a step at least
        assert [o.tokens for o in outs] == reference  # preempted requests restart, same tokens
        assert_no_leaks(eng.cache)


def test_no_memory_is_an_answer_not_a_hang(tiny_models) -> None:
    model = tiny_models[torch.float32]
    with engine(model, make_cache(model, device_pages=8)) as eng:
        with pytest.raises(ConfigError, match="device_pages"):
            eng.add_request(toks(200, 60), GREEDY)
        (out,) = eng.generate([toks(100, 61)], SamplingParams(max_new_tokens=60))
        assert out.finish_reason is FinishReason.NO_MEMORY and 0 < len(out.tokens) < 60
        assert_no_leaks(eng.cache)


def test_whole_prompt_cached_recomputes_its_last_page_into_a_fresh_page(tiny_models) -> None:
    model = tiny_models[torch.bfloat16]
    prompt = toks(4 * PAGE, 70)
    with engine(model, make_cache(model), deterministic=True) as eng:
        cold, hit = (eng.generate([prompt], GREEDY)[0] for _ in range(2))
        assert hit.lengths.prefix_len == 3 * PAGE and hit.lengths.extend_len == PAGE
        assert hit.tokens == cold.tokens and torch.equal(hit.prefill_logits, cold.prefill_logits)
        assert_no_leaks(eng.cache)


def test_abort_at_every_stage_releases_everything(tiny_models, tmp_path) -> None:
    model = tiny_models[torch.float32]
    doc = toks(64, 80)
    with engine(model, make_cache(model, l3_dir=tmp_path)) as eng:
        eng.generate([doc + toks(4, 81)], GREEDY)
    with engine(model, make_cache(model, l3_dir=tmp_path), token_budget=32) as eng:
        sched = eng.scheduler
        in_l3 = eng.add_request(doc + toks(9, 82), GREEDY)
        assert sched.waiting[0].ticket is not None  # prefetch in flight
        assert eng.abort(in_l3).finish_reason is FinishReason.ABORTED
        long, queued = eng.add_request(toks(120, 83), GREEDY), eng.add_request(toks(9, 84), GREEDY)
        eng.step()
        assert [r.state for r in sched.running] == [RequestState.PREFILLING]
        assert sched.waiting[0].id == queued
        assert eng.abort(queued).finish_reason is FinishReason.ABORTED
        assert eng.abort(long).finish_reason is FinishReason.ABORTED
        decoding = eng.add_request(toks(20, 85), SamplingParams(max_new_tokens=50))
        while not eng.scheduler.running or len(eng.scheduler.running[0].output) < 5:
            eng.step()
        partial = eng.abort(decoding)
        assert partial.finish_reason is FinishReason.ABORTED and len(partial.tokens) >= 5
        done = eng.generate([doc + toks(9, 82)], GREEDY)[0]
        assert eng.abort(done.request_id) is None and eng.abort(12345) is None
        assert not eng.has_unfinished
        assert_no_leaks(eng.cache)
        check_lengths(done)


def test_a_request_keeps_the_id_its_caller_gives_and_an_id_in_use_is_refused(tiny_models):
    """One request id from the server to the ranks: the instance passes its id down, and the
    engine's own numbering goes on after it."""
    model = tiny_models[torch.float32]
    with engine(model, make_cache(model)) as eng:
        params = SamplingParams(max_new_tokens=3)
        assert eng.add_request(toks(20, 1), params, request_id=41) == 41
        with pytest.raises(ConfigError, match="request id 41 is held"):
            eng.add_request(toks(20, 2), params, request_id=41)
        assert eng.add_request(toks(20, 3), params) == 42  # the next after the given one
        done = {}
        for _ in range(50):
            done.update({o.request_id: o for o in eng.step()})
            if len(done) == 2:
                break
        assert sorted(done) == [41, 42]
        assert eng.add_request(toks(20, 2), params, request_id=41) == 41  # free again
