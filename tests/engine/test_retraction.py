"""Retraction: a decoding request pushed out of a full L1 keeps its KV in L2 pages of its own
and resumes where it stopped; no token is computed twice and the answer is the one a roomy
L1 gives. Where L2 cannot take it (full, absent, a hybrid model) it is recomputed instead.
TP=2 ranks (threads, one agreement per step) retract, restore and fall back together."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import pytest
import torch
from cache_builder import build_cache
from test_rank_model import ThreadCollective, step_in_threads
from test_scheduler import assert_no_leaks, make_cache, toks

from kvtier.engine import (Engine, FinishReason, Output, RequestState, SamplingParams,
                           TensorParallel, load_tiny_model)
from kvtier.tiers.hierarchical_cache import HierarchicalCache

PAGE = 16
PROMPTS = [toks(60, 50 + i) for i in range(4)]  # 4 pages each
LONG = SamplingParams(max_new_tokens=40)
SMALL_L1, ROOMY_L1 = 13, 64  # three 60-token prompts fit; their answers then outgrow it


class Run(NamedTuple):
    outs: list[Output]  # by request id
    prefill_tokens: int  # summed over the steps
    decode_tokens: int
    preempted: int


def run(eng: Engine, prompts: Sequence[list[int]], params: SamplingParams = LONG) -> Run:
    for p in prompts:
        eng.add_request(p, params)
    outs: list[Output] = []
    prefill = decode = preempted = 0
    for _ in range(2000):
        if not eng.has_unfinished:
            break
        outs += eng.step()
        step = eng.last_step
        prefill, decode = prefill + step.prefill_tokens, decode + step.decode_tokens
        preempted += step.preempted
    assert not eng.has_unfinished, "the engine did not finish its requests"
    return Run(sorted(outs, key=lambda o: o.request_id), prefill, decode, preempted)


def roomy(model, deterministic: bool = False, params: SamplingParams = LONG) -> list[Output]:
    with Engine(model, make_cache(model, ROOMY_L1), owns_cache=True,
                deterministic=deterministic) as eng:
        return run(eng, PROMPTS, params).outs


def assert_nothing_recomputed(r: Run) -> None:
    """Every prompt token prefilled once, every output token but the first decoded once."""
    assert r.prefill_tokens == sum(len(p) for p in PROMPTS)
    assert r.decode_tokens == sum(len(o.tokens) - 1 for o in r.outs)
    assert r.preempted == 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_retracted_requests_resume_with_the_roomy_answer(tiny_models, deterministic) -> None:
    model = tiny_models[torch.float32]
    reference = roomy(model, deterministic)
    with Engine(model, make_cache(model, SMALL_L1), owns_cache=True,
                deterministic=deterministic) as eng:
        r = run(eng, PROMPTS)
        counters = eng.scheduler.retraction.counters
        assert counters.retracted_requests > 0  # fails if retraction is off: they recompute
        assert counters.restored_requests == counters.retracted_requests
        assert counters.retract_fallbacks == 0
        assert_nothing_recomputed(r)
        assert [o.tokens for o in r.outs] == [o.tokens for o in reference]
        assert all(len(o.tokens) == LONG.max_new_tokens for o in r.outs)
        if deterministic:  # prompt logits come from the prompt's own chunks: bit-identical
            for o, ref in zip(r.outs, reference):
                assert torch.equal(o.prefill_logits, ref.prefill_logits)
        assert_no_leaks(eng.cache)
        audit = eng.cache.audit()
        assert audit.leaked_pages == 0 and audit.leaked_locks == 0


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_restored_request_decodes_bit_identically(tiny_models, deterministic) -> None:
    """A lone request retracted mid-answer and restored decodes every later token from the KV
    it left, byte for byte: each token's logprobs equal an untouched run's exactly (both
    decode alone, so batch shapes match too)."""
    model = tiny_models[torch.float32]
    params = SamplingParams(max_new_tokens=24, logprobs=3)
    prompt = toks(37, 7)  # a partial last page of prompt, and of prompt + answer when cut
    with Engine(model, make_cache(model, ROOMY_L1), owns_cache=True,
                deterministic=deterministic) as eng:
        (untouched,) = eng.generate([prompt], params)
    with Engine(model, make_cache(model, ROOMY_L1), owns_cache=True,
                deterministic=deterministic) as eng:
        sched = eng.scheduler
        eng.add_request(prompt, params)
        while not sched.running or len(sched.running[0].output) < 10:
            eng.step()
        req = sched.running[0]
        sched._push_out(req)  # what a full L1 does to the newest of several requests
        assert req.state is RequestState.RETRACTED and not req.pages
        assert len(req.output) == 10 and eng.cache.used_host_pages >= 3  # 46 KV tokens
        (out,) = run(eng, []).outs
        assert sched.retraction.counters.restored_requests == 1
        assert out.tokens == untouched.tokens and out.logprobs == untouched.logprobs
        assert torch.equal(out.prefill_logits, untouched.prefill_logits)
        assert_no_leaks(eng.cache)


def test_with_l3_attached_the_released_pages_back_up_as_usual(tiny_models, tmp_path) -> None:
    """The whole pages a retracted request releases go to the tree and on to L2 and L3 under
    the write policy like any request's; its own copy stays out of both and goes back."""
    model = tiny_models[torch.float32]
    reference = roomy(model)
    with Engine(model, make_cache(model, SMALL_L1, l3_dir=tmp_path), owns_cache=True) as eng:
        r = run(eng, PROMPTS)
        assert eng.scheduler.retraction.counters.restored_requests > 0
        assert_nothing_recomputed(r)
        assert [o.tokens for o in r.outs] == [o.tokens for o in reference]
        assert_no_leaks(eng.cache)  # L3 backups drained too
        assert eng.cache.storage.counters.backed_up_tokens > 0


def test_no_room_in_l2_falls_back_to_recompute(tiny_models) -> None:
    model = tiny_models[torch.float32]
    reference = roomy(model)
    with Engine(model, make_cache(model, SMALL_L1), owns_cache=True) as eng:
        host = eng.cache.host_pool.allocator
        blocker = host.alloc(host.num_free)  # another owner holds all of L2
        r = run(eng, PROMPTS)
        counters = eng.scheduler.retraction.counters
        assert counters.retract_fallbacks > 0 and counters.retracted_requests == 0
        assert r.preempted == counters.retract_fallbacks
        assert r.prefill_tokens > sum(len(p) for p in PROMPTS)  # the restarts recomputed
        assert [o.tokens for o in r.outs] == [o.tokens for o in reference]
        host.free(blocker)
        assert_no_leaks(eng.cache)


@pytest.mark.parametrize("kind", ["no_l2", "hybrid"])
def test_without_an_l2_to_swap_to_requests_are_recomputed(tiny_models, tiny_hybrid_models,
                                                          kind) -> None:
    """No L2 at all, or a hybrid model (whose sliding-window KV is not swapped): the pushed
    out request restarts from its prompt, as before retraction, and is counted."""
    if kind == "hybrid":
        model = tiny_hybrid_models[torch.float32]
        build = lambda pages: make_cache(model, pages)  # noqa: E731
    else:
        model = tiny_models[torch.float32]
        build = lambda pages: build_cache(model.kv_spec(PAGE), pages,  # noqa: E731
                                          model="tiny", enable_hierarchical_cache=False)
    with Engine(model, build(ROOMY_L1), owns_cache=True) as eng:
        reference = run(eng, PROMPTS).outs
    with Engine(model, build(SMALL_L1), owns_cache=True) as eng:
        assert not eng.scheduler.retraction.enabled
        r = run(eng, PROMPTS)
        counters = eng.scheduler.retraction.counters
        assert counters.retract_fallbacks == r.preempted > 0
        assert counters.retracted_requests == 0
        assert [o.tokens for o in r.outs] == [o.tokens for o in reference]
        assert_no_leaks(eng.cache)


def test_abort_of_a_retracted_request_gives_its_l2_pages_back(tiny_models) -> None:
    model = tiny_models[torch.float32]
    with Engine(model, make_cache(model, SMALL_L1), owns_cache=True) as eng:
        sched, cache = eng.scheduler, eng.cache
        for p in PROMPTS:
            eng.add_request(p, LONG)
        for _ in range(200):
            eng.step()
            retracted = [r for r in sched.running if r.state is RequestState.RETRACTED]
            if retracted:
                break
        (victim,) = retracted
        cache.flush()
        tree_host = {p for n in cache.tree.nodes() if n.host_value for p in n.host_value}
        held = set(cache.host_pool.allocator.allocated_pages()) - tree_host
        assert len(held) == -(-victim.kv_len // PAGE)  # its whole KV, partial page included
        out = eng.abort(victim.id)
        assert out.finish_reason is FinishReason.ABORTED and len(out.tokens) > 1
        assert not sched.retraction.holding
        assert not held & set(cache.host_pool.allocator.allocated_pages())
        others = run(eng, [])  # the rest finish; nothing leaks
        assert len(others.outs) == 3
        assert_no_leaks(cache)
        audit = cache.audit()
        assert audit.leaked_pages == 0 and audit.leaked_locks == 0


# ---- TP=2: ranks as threads, one agreement per step ---------------------------------------
def tp2_engines(device_pages: int, coll: ThreadCollective) -> list[Engine]:
    engines = []
    for rank in range(2):
        tp = TensorParallel(rank, 2, reduce_fn=coll.reduce_for(rank))
        model = load_tiny_model(torch.float32, "cpu", tp=tp)
        cache = build_cache(model.kv_spec(PAGE), device_pages, model="tiny", tp_rank=rank,
                            tp_size=2, hicache_ratio=4.0, load_back_threshold_tokens=PAGE)
        engine = Engine(model, cache, owns_cache=True)
        engine.scheduler.agree = coll.agree_for(rank)
        engines.append(engine)
    return engines


def fail_once(cache: HierarchicalCache) -> list[int]:
    """Make the cache's next swap-in fail (a failed L2->L1 copy); the list counts failures."""
    real, failed = cache.swap_in, []

    def swap_in(host_pages, device_pages) -> bool:
        if not failed:
            failed.append(1)
            return False
        return real(host_pages, device_pages)

    cache.swap_in = swap_in
    return failed


def tp2_run(device_pages: int, full_l2_rank: int | None = None,
            failed_restore_rank: int | None = None
            ) -> tuple[list[tuple[int, ...]], list[dict[str, int]]]:
    """Tokens by request, and each rank's retraction counters."""
    coll = ThreadCollective(2)
    engines = tp2_engines(device_pages, coll)
    try:
        if failed_restore_rank is not None:
            failed = fail_once(engines[failed_restore_rank].cache)
        host = engines[full_l2_rank].cache.host_pool.allocator if full_l2_rank is not None \
            else None
        blocker = host.alloc(host.num_free) if host is not None else None
        for p in PROMPTS:
            assert len({e.add_request(p, LONG) for e in engines}) == 1
        outs: dict[int, tuple[int, ...]] = {}
        for _ in range(300):
            results = step_in_threads(engines, coll)
            assert [(o.request_id, o.tokens) for o in results[0]] == \
                [(o.request_id, o.tokens) for o in results[1]]
            states = [[(r.id, r.state, len(r.output)) for r in e.scheduler.running]
                      for e in engines]
            assert states[0] == states[1], "the ranks diverged"
            outs.update((o.request_id, o.tokens) for o in results[0])
            if not any(e.has_unfinished for e in engines):
                break
        if blocker is not None:
            host.free(blocker)
        if failed_restore_rank is not None:
            assert failed, "a restore was tried on the failing rank"
        for e in engines:
            assert_no_leaks(e.cache)
        return ([outs[i] for i in sorted(outs)],
                [e.scheduler.retraction.counters.snapshot() for e in engines])
    finally:
        for e in engines:
            e.close()


def test_tp2_ranks_retract_and_restore_together() -> None:
    reference, _ = tp2_run(ROOMY_L1)
    tokens, counters = tp2_run(SMALL_L1)
    assert tokens == reference and len(tokens) == len(PROMPTS)
    assert counters[0] == counters[1]
    assert counters[0]["restored_requests"] == counters[0]["retracted_requests"] > 0
    assert counters[0]["retract_fallbacks"] == 0
    # one rank's first restore fails: every rank gives its pages back and tries again
    tokens, counters = tp2_run(SMALL_L1, failed_restore_rank=1)
    assert tokens == reference and counters[0] == counters[1]
    assert counters[0]["restored_requests"] == counters[0]["retracted_requests"] > 0
    # one rank without L2 room: every rank recomputes the victim instead
    tokens, counters = tp2_run(SMALL_L1, full_l2_rank=1)
    assert tokens == reference
    assert counters[0] == counters[1] and counters[0]["retracted_requests"] == 0
    assert counters[0]["retract_fallbacks"] > 0
