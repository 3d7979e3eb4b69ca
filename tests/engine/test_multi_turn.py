"""Multi-turn reuse through the Engine (default mode): hits that end on any page, generated
pages cached and byte-exact through every tier, batched prefill, lpm admission with its aging
bound, and best_effort prefetches that end only when admission reaches their request."""
from __future__ import annotations

import pytest
import torch
from cache_builder import build_cache
from eventually import eventually
from test_scheduler import assert_no_leaks, check_lengths, make_cache, toks

from kvtier.backends.base import StorageTarget
from kvtier.backends.faulty import FaultKind, FaultyBackend, StorageOp
from kvtier.backends.registry import create_backend
from kvtier.engine import Engine, RequestState, SamplingParams
from kvtier.engine import scheduler as scheduler_module
from kvtier.engine.forward_plan import Piece, pack_forwards
from kvtier.engine.queue_order import order_waiting
from kvtier.engine.request import Request
from kvtier.policies import SchedulePolicy
from kvtier.tiers.hierarchical_cache import HierarchicalCache

PAGE = 16
ONE = SamplingParams(max_new_tokens=1)


def l1_bytes(cache: HierarchicalCache, tokens: list[int]) -> list[torch.Tensor]:
    """The L1 bytes of every cached whole page of `tokens` (each page's K and V, all layers)."""
    m = cache.tree.match_prefix(tokens, touch=False)
    kv = cache.device_pool.kv
    return [kv[:, :, page].clone() for page in m.device_indices]


# ---- hits on any page ------------------------------------------------------------------------
def test_a_hit_ends_on_any_page_whatever_the_chunk_size(tiny_models) -> None:
    model = tiny_models[torch.float32]
    prompt = toks(170, 1)  # 10 pages + 10 tokens; chunks of 128 would reuse 128
    with Engine(model, make_cache(model), 128, owns_cache=True) as eng:
        cold, hit = (eng.generate([prompt], ONE)[0] for _ in range(2))
        assert hit.cached.device == 160 and hit.lengths.extend_len == 10
        assert hit.tokens == cold.tokens
        check_lengths(hit)
        assert_no_leaks(eng.cache)


# ---- generated pages ---------------------------------------------------------------------------
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_the_next_turn_hits_the_previous_answer(tiny_models, deterministic) -> None:
    model = tiny_models[torch.float32]
    first = toks(40, 2)
    with Engine(model, make_cache(model), owns_cache=True, deterministic=deterministic) as eng:
        answer = eng.generate([first], SamplingParams(max_new_tokens=20))[0]
        second = first + list(answer.tokens) + toks(10, 3)
        turn2 = eng.generate([second], ONE)[0]
        # Prompt (40) + answer (20, the last without KV) = 59 tokens: 3 whole pages. Only the
        # prompt's 2 whole pages in deterministic mode.
        assert turn2.cached.device == (32 if deterministic else 48)
        check_lengths(turn2)
        assert_no_leaks(eng.cache)


def test_generated_pages_are_byte_exact_in_every_tier(tiny_models, tmp_path) -> None:
    model = tiny_models[torch.float32]
    prompt = toks(20, 4)
    with Engine(model, make_cache(model, l3_dir=tmp_path), owns_cache=True) as eng:
        answer = eng.generate([prompt], SamplingParams(max_new_tokens=30))[0]
        computed = prompt + list(answer.tokens[:-1])  # 49 tokens: pages 2 and 3 hold output
        written = l1_bytes(eng.cache, computed)
        assert len(written) == 3
        eng.cache.flush()
        eng.cache.storage.drain()  # L1 -> L2 -> L3
        eng.cache.evict_device(10**9)
        from_l2 = eng.generate([computed + [5]], ONE)[0]
        assert from_l2.cached.host == 48
        assert all(torch.equal(a, b) for a, b in zip(written, l1_bytes(eng.cache, computed)))
    other = make_cache(model, l3_dir=tmp_path)  # another instance on the same L3
    with Engine(model, other, owns_cache=True) as eng:
        from_l3 = eng.generate([computed + [5]], ONE)[0]
        assert from_l3.cached.storage == 48
        got = l1_bytes(other, computed)
        assert len(got) == 3 and all(torch.equal(a, b) for a, b in zip(written, got))
        assert from_l3.tokens == from_l2.tokens
        assert torch.equal(from_l3.prefill_logits, from_l2.prefill_logits)


def test_a_long_generation_stores_each_page_as_it_fills(tiny_models, tmp_path) -> None:
    model = tiny_models[torch.float32]
    prompt = toks(24, 8)  # 1 page + 8 tokens
    params = SamplingParams(max_new_tokens=60, stop_token_ids=())
    with Engine(model, make_cache(model, l3_dir=tmp_path), owns_cache=True) as eng:
        rid = eng.add_request(prompt, params)
        req = next(r for r in eng.scheduler.waiting if r.id == rid)
        seen = []  # whole pages the tree holds of the running request's computed tokens
        while req.state is not RequestState.FINISHED:
            eng.step()
            if req.state is RequestState.DECODING:
                cached = eng.cache.tree.match_prefix(list(req.computed), touch=False)
                assert len(cached.device_indices) == len(req.computed) // PAGE
                seen.append(len(cached.device_indices))
        # The prompt's page right after prefill, then each page the answer fills: 83 computed
        # tokens (24 + 60 - 1) are 5 whole pages, all stored before the request ended.
        assert seen[0] == 1 and sorted(set(seen)) == [1, 2, 3, 4, 5] and seen == sorted(seen)
        eng.cache.flush()
        eng.cache.storage.drain()
        computed = list(req.computed)
        written = l1_bytes(eng.cache, computed)
        assert len(written) == 5
        eng.cache.evict_device(10**9)
        from_l2 = eng.generate([computed + [7]], ONE)[0]
        assert from_l2.cached.host == 80
        assert all(torch.equal(a, b) for a, b in zip(written, l1_bytes(eng.cache, computed)))
        assert_no_leaks(eng.cache)


def test_a_concurrent_request_hits_a_running_requests_prompt(tiny_models) -> None:
    model = tiny_models[torch.float32]
    prompt = toks(50, 9)  # 3 whole pages
    params = SamplingParams(max_new_tokens=10)
    with Engine(model, make_cache(model), owns_cache=True) as eng:
        first = eng.add_request(prompt, params)
        eng.step()  # prefill: the prompt's pages are in the tree once it decodes
        second = eng.add_request(prompt, params)
        outs = {}
        while eng.has_unfinished:
            outs.update((o.request_id, o) for o in eng.step())
        assert outs[first].cached.device == 0 and outs[second].cached.device == 48
        assert outs[second].tokens == outs[first].tokens
        check_lengths(outs[second])
        assert_no_leaks(eng.cache)


# ---- batched prefill ---------------------------------------------------------------------------
def test_forwards_pack_pieces_and_decodes_under_the_cap() -> None:
    a, b, d = object(), object(), object()
    fwds = pack_forwards([Piece(a, 0, 10), Piece(b, 16, 20)], [d], 8)
    assert [(len(f.pieces), len(f.decodes), f.num_tokens) for f in fwds] == [(1, 1, 8), (2, 0, 7)]
    assert fwds[0].pieces == (Piece(a, 0, 7),)
    assert fwds[1].pieces == (Piece(a, 7, 10), Piece(b, 16, 20))  # a's rest first, in order
    assert pack_forwards([], [d] * 3, 2)[0].decodes == (d, d, d)  # decodes never wait


def test_batched_prefill_equals_one_at_a_time_within_tolerance(tiny_models) -> None:
    model = tiny_models[torch.float32]
    prompts = [toks(40, 5), toks(23, 6), toks(70, 7)]
    params = SamplingParams(max_new_tokens=8)
    with Engine(model, make_cache(model), 256, owns_cache=True) as eng:
        ids = [eng.add_request(p, params) for p in prompts]
        outs = eng.step()
        assert eng.last_step.forwards == 1 and eng.last_step.prefill_tokens == 133
        while eng.has_unfinished:
            outs += eng.step()
        batched = {o.request_id: o for o in outs}
    for i, prompt in zip(ids, prompts):
        with Engine(model, make_cache(model), owns_cache=True, deterministic=True) as alone:
            ref = alone.generate([prompt], params)[0]
        got = batched[i]
        torch.testing.assert_close(got.prefill_logits, ref.prefill_logits, atol=1e-4, rtol=1e-4)
        assert got.tokens == ref.tokens


# ---- lpm ---------------------------------------------------------------------------------------
def _req(i: int, hit: int, waited: int = 0) -> Request:
    req = Request(i, (1, 2, 3), ONE)
    req.agreed_hit, req.waited_steps = hit, waited
    return req


def test_lpm_orders_by_agreed_hit_then_arrival_and_aged_requests_first() -> None:
    reqs = [_req(0, 0), _req(1, 64), _req(2, 32), _req(3, 64), _req(4, 0, waited=5)]
    lpm = order_waiting(reqs, SchedulePolicy.LPM, max_wait_steps=5)
    assert [r.id for r in lpm] == [4, 1, 3, 2, 0]
    assert [r.id for r in order_waiting(reversed(reqs), SchedulePolicy.FCFS)] == [0, 1, 2, 3, 4]


def _starved_steps(model, max_wait_steps: int, steps: int) -> int | None:
    """A no-hit request waits while two requests that hit arrive every step and the budget
    admits about one per step; the steps it waited before admission (None: not admitted)."""
    prefix = toks(48, 8)
    with Engine(model, make_cache(model, device_pages=128), 64, token_budget=64,
                owns_cache=True) as eng:
        eng.generate([prefix + [1]], ONE)  # the prefix is in L1
        eng.scheduler.max_wait_steps = max_wait_steps
        for k in range(2):
            eng.add_request(prefix + toks(40, 100 + k), ONE)
        eng.step()
        cold = eng.add_request(toks(60, 9), ONE)
        for k in range(steps):
            for j in range(2):
                eng.add_request(prefix + toks(40, 200 + 2 * k + j), ONE)
            eng.step()
            if all(r.id != cold for r in eng.scheduler.waiting):
                return k + 1
        return None


def test_lpm_aging_bounds_the_wait_of_a_request_with_no_hit(tiny_models) -> None:
    model = tiny_models[torch.float32]
    assert _starved_steps(model, max_wait_steps=10**6, steps=12) is None  # lpm alone starves it
    waited = _starved_steps(model, max_wait_steps=4, steps=12)
    assert waited is not None and waited <= 4 + 1


def test_lpm_admits_the_longest_agreed_hit_first(tiny_models) -> None:
    model = tiny_models[torch.float32]
    prefix = toks(48, 10)
    with Engine(model, make_cache(model), 64, token_budget=64, owns_cache=True) as eng:
        eng.generate([prefix + [1]], ONE)
        eng.add_request(toks(200, 11), ONE)  # takes the budget for a few steps
        eng.step()
        miss = eng.add_request(toks(50, 12), ONE)  # arrives first: fcfs would admit it first
        hit = eng.add_request(prefix + toks(30, 13), ONE)
        left: dict[int, int] = {}  # request id -> the step it left the waiting queue in
        for step in range(1, 50):
            eng.step()
            for i in (miss, hit):
                if i not in left and all(r.id != i for r in eng.scheduler.waiting):
                    left[i] = step
            if not eng.has_unfinished:
                break
        assert left[hit] < left[miss]


# ---- best_effort -------------------------------------------------------------------------------
def _simulated_cache(model, seed: int) -> tuple[HierarchicalCache, FaultyBackend]:
    cache = build_cache(model.kv_spec(PAGE), 64, model="tiny", hicache_ratio=4.0,
                        load_back_threshold_tokens=PAGE, prefetch_policy="best_effort",
                        prefetch_threshold_tokens=PAGE, mem_layout="page_head")
    backend = FaultyBackend(create_backend("simulated", StorageTarget(cache.namespace, cache.heads),
                                           {"seed": seed}))
    cache.attach_storage(backend)
    return cache, backend


def _store_in_l3(model, doc: list[int], seed: int) -> None:
    """Another instance computes `doc` and backs it up to the simulated L3 of `seed`."""
    with Engine(model, _simulated_cache(model, seed)[0], owns_cache=True) as eng:
        eng.generate([doc + [1]], ONE)
        eng.cache.flush()
        eng.cache.storage.drain()


def test_best_effort_uses_the_pages_that_landed_while_its_request_waited(tiny_models) -> None:
    model = tiny_models[torch.float32]
    doc = toks(64, 14)
    _store_in_l3(model, doc, seed=1415)
    cache, backend = _simulated_cache(model, seed=1415)
    backend.inject(StorageOp.GET, FaultKind.DELAY, times=-1, delay_s=2.0)
    with Engine(model, cache, 32, token_budget=32, owns_cache=True,
                schedule_policy=SchedulePolicy.FCFS) as eng:
        eng.add_request(toks(200, 15), ONE)  # prefills 32 tokens a step for 7 steps
        eng.step()
        req_id = eng.add_request(doc + toks(5, 16), ONE)
        waiting = eng.scheduler.waiting[0]
        assert waiting.ticket is not None
        for _ in range(2):  # the budget never reaches it: its prefetch goes on
            eng.step()
            assert waiting.state is RequestState.WAITING and waiting.ticket is not None
        eventually(lambda: waiting.ticket.op.state.finished, 30, "its prefetch finished")
        outs = []
        while eng.has_unfinished:
            outs += eng.step()
        (out,) = [o for o in outs if o.request_id == req_id]
        assert out.cached.storage == 64
        assert backend.faults.injected.get("get:delay", 0) >= 1  # its reads were slow
        check_lengths(out)


def test_a_lone_best_effort_request_uses_the_batch_its_prefetch_reads(tiny_models) -> None:
    """Alone, a request is reached by admission within a millisecond of its prefetch's
    submission, usually before the storage worker has taken the read up: that first batch
    is still read and used (the matrix's round 2 of configuration 3)."""
    model = tiny_models[torch.float32]
    doc = toks(64, 20)
    _store_in_l3(model, doc, seed=2021)
    for k in range(3):
        with Engine(model, _simulated_cache(model, seed=2021)[0], owns_cache=True) as eng:
            (out,) = eng.generate([doc + toks(5, 22 + k)], ONE)
            assert out.cached.storage == 64
            check_lengths(out)


# ---- retried prefetches ------------------------------------------------------------------------
@pytest.mark.parametrize("retry_s", [0.0, 3600.0], ids=["retried", "never-retried"])
def test_a_request_that_found_nothing_in_l3_asks_again_while_it_waits(tiny_models, tmp_path,
                                                                      monkeypatch, retry_s):
    """It arrives before another instance has stored its prefix in L3, waits behind a long
    prefill, and the prefix lands meanwhile: a retry finds it (the rate limit, here 0 or an
    hour, decides whether it asks again)."""
    monkeypatch.setattr(scheduler_module, "RETRY_PREFETCH_S", retry_s)
    model = tiny_models[torch.float32]
    doc = toks(64, 17)
    with Engine(model, make_cache(model, l3_dir=tmp_path), 32, token_budget=32,
                owns_cache=True, schedule_policy=SchedulePolicy.FCFS) as eng:
        eng.add_request(toks(200, 18), ONE)  # prefills 32 tokens a step for 7 steps
        eng.step()
        req_id = eng.add_request(doc + toks(5, 19), ONE)
        assert eng.scheduler.waiting[0].ticket is None  # L3 has nothing of it yet
        writer = make_cache(model, l3_dir=tmp_path)  # another instance on the same L3
        with Engine(model, writer, owns_cache=True) as other:
            other.generate([doc + [1]], ONE)
            writer.flush()
            writer.storage.drain()
        outs = []
        while eng.has_unfinished:
            outs += eng.step()
        (out,) = [o for o in outs if o.request_id == req_id]
        counters = eng.cache.storage.counters
        if retry_s:
            assert out.cached.storage == 0 and counters.retried_lookups == 0
        else:
            assert out.cached.storage == 64 and counters.retried_hit_tokens == 64
        check_lengths(out)
        assert_no_leaks(eng.cache)


# ---- tenants -----------------------------------------------------------------------------------
def test_a_cache_salt_hits_only_its_own_prefixes_and_answers_alike(tiny_models) -> None:
    """Requests with another cache salt recompute the prompt (their answer equal); requests
    with the same salt hit it, the running one's generated pages included."""
    model = tiny_models[torch.float32]
    prompt = toks(50, 11)  # 3 whole pages
    params = SamplingParams(max_new_tokens=20)
    with Engine(model, make_cache(model), owns_cache=True) as eng:
        def run(salt: str, tokens=prompt):
            req = eng.add_request(tokens, params, cache_salt=salt)
            outs = {}
            while eng.has_unfinished:
                outs.update((o.request_id, o) for o in eng.step())
            return outs[req]
        a = run("tenant-a")
        for salt in ("tenant-b", "", "tenant-a2"):
            other = run(salt)
            assert other.cached.total == 0 and other.tokens == a.tokens, salt
        again = run("tenant-a")
        assert again.cached.device == 48 and again.tokens == a.tokens
        turn2 = run("tenant-a", prompt + list(a.tokens) + toks(5, 12))
        assert turn2.cached.device == 64  # 50 + 19 computed tokens: 4 whole pages
        check_lengths(turn2)
        assert_no_leaks(eng.cache)
        assert eng.cache.tree.num_salts == 3  # tenant-a, tenant-b, tenant-a2 ("" is unsalted)
        with pytest.raises(Exception, match="cache salt"):
            eng.add_request(prompt, params, cache_salt=3)
