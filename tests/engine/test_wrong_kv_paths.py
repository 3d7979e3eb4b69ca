"""Error paths that could put wrong KV into L2 or L3, each closed and checked byte for byte.

1. L3 attached while an L1->L2 copy is still in flight: only landed copies are backed up.
2. An L1->L2 copy that fails: its L2 pages are forgotten (never loaded back, never sent to
   L3), the run is unlocked and stays in L1.
3. An L2->L1 load that fails: the requests using it are recomputed, the partly loaded L1 pages
   leave the tree (their L2 copies stay), no lock is left behind; a request whose loads keep
   failing ends with an error; at TP > 1 a load failed on one rank is recomputed on every rank
   in the same step (the forward goes on, its rows poisoned), nothing else disturbed.
Copies are made to block or fail by wrapping the controller's page copy (a fixture, as the
controller tests do).
"""
from __future__ import annotations

import threading

import pytest
import torch
from cache_builder import build_cache
from test_rank_model import Ranks, step_in_threads
from test_scheduler import assert_no_leaks, make_cache, toks

from kvtier.backends.base import StorageTarget
from kvtier.backends.registry import create_backend
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.request import FinishReason
from kvtier.kv_spec import KVSpec
from kvtier.tiers import controller as controller_module
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.reference_kv import prefix_kv_matches, write_prefix_kv

PARAMS = SamplingParams(max_new_tokens=4)
PAGE = 16
WAIT_S = 30.0  # hang guard only


class CopyGate:
    """Wraps the controller's copy: L1->L2 copies (device source) can be held or made to fail,
    L2->L1 copies (host source) made to fail."""

    def __init__(self, monkeypatch) -> None:
        self.hold_writes = threading.Event()  # set: writes wait for `release`
        self.release = threading.Event()
        self.fail_writes = self.fail_loads = 0
        self.failed = 0
        self.loads_into = -1  # >= 0: only loads into the L1 pool at this address fail
        real = controller_module.copy_pages

        def copy(src, dst, plan, backend, layers=slice(None), non_blocking=False):
            is_write = src.data_ptr() == self.device_ptr  # from the L1 pool
            if is_write and self.hold_writes.is_set():
                assert self.release.wait(WAIT_S)
            if is_write and self.fail_writes:
                self.fail_writes -= 1
                self.failed += 1
                raise RuntimeError("injected L1->L2 copy failure")
            if not is_write and self.fail_loads and self.loads_into in (-1, dst.data_ptr()):
                self.fail_loads -= 1
                self.failed += 1
                pages = torch.tensor(list(plan.dst_pages))
                dst[:, layers].index_fill_(2, pages, 7.0)  # the failed load left garbage
                raise RuntimeError("injected L2->L1 copy failure")
            real(src, dst, plan, backend, layers, non_blocking)

        self.device_ptr = -1
        monkeypatch.setattr(controller_module, "copy_pages", copy)

    def watch(self, cache: HierarchicalCache) -> None:
        self.device_ptr = cache.device_pool.layer_page_view().data_ptr()


@pytest.fixture
def gate(monkeypatch) -> CopyGate:
    return CopyGate(monkeypatch)


SPEC_TOKENS = 4 * PAGE


def _cache(device_pages: int = 32) -> HierarchicalCache:
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=PAGE, dtype=torch.float32)
    return build_cache(spec, device_pages, hicache_ratio=2.0, load_back_threshold_tokens=PAGE,
                       prefetch_policy="wait_complete", prefetch_threshold_tokens=PAGE,
                       mem_layout="page_head")


def _compute(cache: HierarchicalCache, tokens: list[int]):
    """One request through the facade: its KV written as a pure function of the tokens."""
    lookup = cache.lookup(tokens)
    fresh = cache.allocate(-(-len(tokens) // PAGE) - len(lookup.device_pages))
    for layer in range(cache.spec.num_layers):
        cache.wait_layer(layer)
    write_prefix_kv(cache.device_pool.kv, cache.spec, tokens, fresh,
                    first_page=len(lookup.device_pages))
    cache.finish(lookup, tokens, lookup.device_pages + fresh)
    return lookup


def test_attaching_l3_backs_up_only_copies_that_have_landed(gate):
    tokens = toks(SPEC_TOKENS, 1)
    with _cache() as cache:
        gate.watch(cache)
        gate.hold_writes.set()
        _compute(cache, tokens)  # write-through: its L1->L2 copy is queued and held
        backend = create_backend("simulated", StorageTarget(cache.namespace, cache.heads), {"seed": 1})
        attach = threading.Thread(target=cache.attach_storage, args=(backend,))
        attach.start()
        attach.join(0.5)
        gate.hold_writes.clear()
        gate.release.set()  # the copy lands now; only then may L3 get these pages
        attach.join(WAIT_S)
        assert not attach.is_alive()
        cache.flush()
        cache.storage.drain()
        cache.drop_unlocked()  # L1 and L2 forget; L3 is all that is left
        ticket = cache.prefetch(tokens)
        assert ticket is not None
        while not cache.prefetch_ready(ticket):
            ticket.op._settled.wait(0.01)
        assert cache.finish_prefetch(ticket) > 0
        lookup = cache.lookup(tokens)
        for layer in range(cache.spec.num_layers):
            cache.wait_layer(layer)
        assert lookup.cached_len > 0
        assert prefix_kv_matches(cache.device_pool.kv, cache.spec, tokens[:lookup.cached_len],
                                 lookup.device_pages), "L3 holds bytes of a copy not yet landed"
        cache.abort(lookup)


def test_a_failed_l1_to_l2_copy_is_forgotten_and_never_loaded_back(gate):
    tokens = toks(SPEC_TOKENS, 2)
    with _cache() as cache:
        gate.watch(cache)
        gate.fail_writes = 1
        _compute(cache, tokens)
        cache.flush()  # the failure is settled here, not raised
        assert gate.failed == 1
        assert cache.counters.failed_backup_tokens == SPEC_TOKENS
        audit = cache.audit()
        assert audit.leaked_locks == 0 and audit.leaked_pages == 0
        assert cache.used_host_pages == 0  # no L2 page points at the failed copy
        cache.evict_device(cache.device_pages)  # nothing to demote: the run is dropped
        assert cache.peek(tokens) == (0, 0)
        lookup = _compute(cache, tokens)  # recomputed, and this time copied for real
        assert lookup.cached_len == 0
        cache.flush()
        cache.evict_device(cache.device_pages)
        again = cache.lookup(tokens)
        for layer in range(cache.spec.num_layers):
            cache.wait_layer(layer)
        assert again.host_loaded_length == SPEC_TOKENS
        assert prefix_kv_matches(cache.device_pool.kv, cache.spec, tokens, again.device_pages)
        cache.abort(again)


def test_a_failed_l2_to_l1_load_is_recomputed_and_leaves_nothing_behind(gate, tiny_models):
    model = tiny_models[torch.float32]
    prompt = toks(3 * 16 + 5, 3)
    with Engine(model, make_cache(model, device_pages=32), owns_cache=True) as cold_engine:
        cold = cold_engine.generate([prompt], PARAMS)[0]
    cache = make_cache(model, device_pages=32)
    with Engine(model, cache, owns_cache=True) as eng:
        gate.watch(cache)
        eng.generate([prompt], PARAMS)
        cache.flush()
        cache.evict_device(cache.device_pages)  # the prompt's pages are in L2 only
        gate.fail_loads = 1
        hit = eng.generate([prompt, prompt], PARAMS)  # both use the one failing load
        assert gate.failed == 1
        assert [o.tokens for o in hit] == [cold.tokens, cold.tokens]
        assert cache.counters.failed_load_tokens > 0
        assert_no_leaks(cache)
        again = eng.generate([prompt], PARAMS)[0]  # the L2 copy is intact: it loads back
        assert again.tokens == cold.tokens and again.cached.total > 0
        assert_no_leaks(cache)


def test_a_request_whose_loads_keep_failing_ends_with_an_error(gate, tiny_models):
    model = tiny_models[torch.float32]
    prompt = toks(3 * 16 + 5, 4)
    cache = make_cache(model, device_pages=32)
    with Engine(model, cache, owns_cache=True) as eng:
        gate.watch(cache)
        first = eng.generate([prompt], PARAMS)[0]
        cache.flush()
        cache.evict_device(cache.device_pages)
        gate.fail_loads = 100  # every load back from L2 fails
        out = eng.generate([prompt], PARAMS)[0]
        assert out.finish_reason is FinishReason.ERROR and out.tokens == ()
        assert gate.failed == 3  # MAX_FAILED_READS tries, then it ends
        gate.fail_loads = 0
        assert_no_leaks(cache)
        again = eng.generate([prompt], PARAMS)[0]  # the L2 copy is intact
        assert again.tokens == first.tokens and again.cached.total > 0


def test_tp3_a_load_failed_on_one_rank_is_recomputed_on_every_rank(gate):
    """Rank 1's load back of a prompt fails mid-forward while another request decodes: every
    rank finishes the forward, sees the prompt's rows non-finite and recomputes it; the
    decoding request goes on; answers are the cold ones; nothing leaks."""
    prompt, other = toks(3 * PAGE + 5, 5), toks(2 * PAGE + 3, 6)
    long = SamplingParams(max_new_tokens=12)
    ranks = Ranks(device_pages=32)
    try:
        def run(ids: set[int]) -> dict:
            done = {}
            for _ in range(200):
                results = step_in_threads(ranks.engines, ranks.coll)
                outs = [[(o.request_id, o.tokens, o.finish_reason) for o in r] for r in results]
                assert all(o == outs[0] for o in outs), "ranks finished different requests"
                done.update((o[0], o) for o in outs[0])
                if ids <= set(done):
                    return done
            raise AssertionError(f"unfinished: {ids - set(done)}")

        cold = run({ranks.add(prompt)})
        for engine in ranks.engines:
            engine.cache.flush()
            engine.cache.evict_device(engine.cache.device_pages)  # the prompt: in L2 only
        ids = [engine.add_request(other, long) for engine in ranks.engines]
        step_in_threads(ranks.engines, ranks.coll)  # `other` prefills, then decodes
        gate.loads_into = ranks.engines[1].cache.device_pool.layer_page_view().data_ptr()
        gate.fail_loads = 1
        again = ranks.add(prompt)
        done = run({again, ids[0]})
        assert gate.failed == 1
        assert done[again][1:] == cold[next(iter(cold))][1:]
        assert done[ids[0]][2] is FinishReason.LENGTH and len(done[ids[0]][1]) == 12
        counters = [e.cache.counters.failed_load_tokens for e in ranks.engines]
        assert counters[1] > 0 and counters[0] == counters[2] == 0
        for engine in ranks.engines:
            assert engine.scheduler.last_step.preempted == 0
            assert_no_leaks(engine.cache)
    finally:
        ranks.close()
