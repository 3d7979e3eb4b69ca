"""An in-process model of TP=3 ranks: each rank a thread with its own model shard, its own
HierarchicalCache and its own L3 backend, one MIN collective per step between the threads.

Hypothesis drives random request streams over shared prefixes with rank-local faults (one rank
drops its L1/L2, one rank's L3 lookups fail, one rank refuses an allocation). After every step
every rank must hold the same requests in the same states with the same agreed hit lengths;
every answer must equal the cold answer; at the end no rank leaks a page or a lock; and over
the run every kind of fault really happened (a lookup failed, an allocation was refused), not
only was armed.
"""
from __future__ import annotations

import threading
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from cache_builder import build_cache

from kvtier.backends.base import StorageTarget
from kvtier.backends.faulty import FaultKind, FaultyBackend, StorageOp
from kvtier.backends.registry import create_backend
from kvtier.config import HiCacheConfig
from kvtier.engine import Engine, SamplingParams, TensorParallel, load_tiny_model
from kvtier.engine.agreement import AgreementError, pack, unpack
from kvtier.tiers.hierarchical_cache import HierarchicalCache

SIZE = 3
PAGE = 16
PARAMS = SamplingParams(max_new_tokens=3)
WAIT_S = 60.0  # hang guard only
PREFIXES = [torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (40, 70)]
SUFFIXES = [[7], [9, 9, 3], list(range(20, 40))]


class ThreadCollective:
    """Sum (the model's all-reduce) and MIN (the agreement) over `size` threads, rank order."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=WAIT_S)
        self.parts: list[torch.Tensor | None] = [None] * size
        self.rounds = 0

    def _gather(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.parts[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.parts)
        self.barrier.wait()  # nobody overwrites a part before all have read
        return parts

    def reduce_for(self, rank: int):
        def reduce(x: torch.Tensor) -> None:
            parts = self._gather(rank, x)
            total = parts[0].clone()
            for part in parts[1:]:
                total += part
            x.copy_(total)
        return reduce

    def agree_for(self, rank: int):
        def agree(payload):
            parts = self._gather(rank, pack(payload))
            if rank == 0:
                self.rounds += 1
            agreed = unpack(torch.stack(parts).min(dim=0).values, payload.num_slots)
            if not agreed.consistent:
                raise AgreementError("the ranks packed different waiting queues")
            return agreed
        return agree


def _config() -> HiCacheConfig:
    return HiCacheConfig.from_dict({
        "page_size": PAGE, "hicache_ratio": 3.0, "load_back_threshold_tokens": PAGE,
        "prefetch_policy": "wait_complete", "prefetch_threshold_tokens": PAGE,
        "storage_batch_pages": 2, "mem_layout": "page_head"})


def step_in_threads(engines: list[Engine], coll: ThreadCollective) -> list:
    """One step of every rank engine, each in its own thread; their results in rank order."""
    results: list = [None] * len(engines)
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = engines[rank].step()
        except BaseException as exc:  # surfaced below; a dead rank would hang the others
            errors.append(exc)
            coll.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(engines))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


class Ranks:
    """SIZE engines in lockstep over one thread collective (deterministic by default: answers
    then equal the cold answer bit for bit)."""

    def __init__(self, device_pages: int = 24, deterministic: bool = True,
                 token_budget: int = 8192) -> None:
        self.coll = ThreadCollective(SIZE)
        self.engines: list[Engine] = []
        self.backends: list[FaultyBackend] = []
        self.refusals = [0] * SIZE
        self.refused = 0  # allocations refused so far, all ranks
        for rank in range(SIZE):
            tp = TensorParallel(rank, SIZE, reduce_fn=self.coll.reduce_for(rank))
            model = load_tiny_model(torch.float32, "cpu", tp=tp)
            cache = build_cache(model.kv_spec(PAGE), device_pages, _config(), model="tiny",
                                tp_rank=rank, tp_size=SIZE, deterministic=deterministic)
            backend = FaultyBackend(create_backend(
                "simulated", StorageTarget(cache.namespace, cache.heads), {"seed": rank}),
                seed=rank)
            cache.attach_storage(backend)
            self._gate_allocations(cache, rank)
            engine = Engine(model, cache, PAGE, token_budget, owns_cache=True,
                            deterministic=deterministic)
            engine.scheduler.agree = self.coll.agree_for(rank)
            self.engines.append(engine)
            self.backends.append(backend)

    def _gate_allocations(self, cache: HierarchicalCache, rank: int) -> None:
        real = cache.allocate

        def allocate(num_pages: int):
            if self.refusals[rank] > 0:
                self.refusals[rank] -= 1
                self.refused += 1
                return None
            return real(num_pages)

        cache.allocate = allocate  # a rank-local out-of-memory, on request

    def add(self, tokens: list[int]) -> int:
        ids = {engine.add_request(tokens, PARAMS) for engine in self.engines}
        assert len(ids) == 1
        return ids.pop()

    def step(self) -> list:
        return step_in_threads(self.engines, self.coll)

    def faults_fired(self) -> Counter:
        """The rank-local faults that happened (a drop always does)."""
        lookups = sum(b.faults.injected.get("exists:error", 0) for b in self.backends)
        return Counter(lookup_fails=lookups, refuse=self.refused)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def _state(engine: Engine) -> tuple:
    """What must be identical on every rank after a step."""
    sched = engine.scheduler
    running = tuple((r.id, r.state.name, r.pos, r.num_shared, tuple(r.output))
                    for r in sched.running)
    return running, tuple(r.id for r in sched.waiting)


_COLD: dict[tuple[int, ...], tuple[int, ...]] = {}


def cold_answer(tokens: list[int]) -> tuple[int, ...]:
    """The answer of fresh ranks with nothing cached (same TP=3 arithmetic)."""
    key = tuple(tokens)
    if key not in _COLD:
        ranks = Ranks(device_pages=32)
        try:
            req = ranks.add(tokens)
            for _ in range(200):
                for out in ranks.step()[0]:
                    if out.request_id == req:
                        _COLD[key] = out.tokens
                if key in _COLD:
                    break
        finally:
            ranks.close()
    return _COLD[key]


FAULTS = st.sampled_from(["none", "none", "drop", "lookup_fails", "refuse"])
STREAM = st.lists(st.tuples(st.integers(0, len(PREFIXES) - 1),
                            st.integers(0, len(SUFFIXES) - 1),
                            st.integers(0, 2),  # steps before the next request
                            FAULTS, st.integers(0, SIZE - 1)),
                  min_size=2, max_size=7)


def test_ranks_stay_in_step_under_rank_local_faults():
    fired: Counter = Counter()

    @settings(max_examples=12, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.too_slow])
    @given(STREAM)
    @example([(1, 0, 0, "lookup_fails", 2), (1, 1, 0, "refuse", 1)])  # both fire here
    def streams(stream):
        fired.update(_run_stream(stream))

    streams()
    assert fired["lookup_fails"] >= 1 and fired["refuse"] >= 1, fired


def _run_stream(stream) -> Counter:
    """One stream through fresh ranks, checked step by step; the faults that fired."""
    ranks = Ranks()
    prompts: dict[int, list[int]] = {}
    answers: dict[int, tuple[int, ...]] = {}
    try:
        plan = list(stream)
        for _ in range(400):
            if plan:
                prefix, suffix, pause, fault, rank = plan[0]
                if pause == 0:
                    plan.pop(0)
                    tokens = PREFIXES[prefix] + SUFFIXES[suffix]
                    prompts[ranks.add(tokens)] = tokens
                    _inject(ranks, fault, rank)
                else:
                    plan[0] = (prefix, suffix, pause - 1, fault, rank)
            results = ranks.step()
            states = [_state(engine) for engine in ranks.engines]
            assert all(s == states[0] for s in states), f"ranks diverged: {states}"
            finished = [[(o.request_id, o.tokens) for o in res] for res in results]
            assert all(f == finished[0] for f in finished)
            answers.update(dict(finished[0]))
            if not plan and not any(e.has_unfinished for e in ranks.engines):
                break
        assert set(answers) == set(prompts), "every request is answered"
        for req_id, tokens in prompts.items():
            assert answers[req_id] == cold_answer(tokens), f"request {req_id}: wrong answer"
        for rank, engine in enumerate(ranks.engines):
            ranks.backends[rank].release()
            engine.cache.flush()
            engine.cache.storage.drain()
            audit = engine.cache.audit()
            assert audit.leaked_pages == 0 and audit.leaked_locks == 0, (rank, audit)
            assert audit.open_prefetches == 0, (rank, audit)
        return ranks.faults_fired()
    finally:
        ranks.close()


def _inject(ranks: Ranks, fault: str, rank: int) -> None:
    if fault == "drop":
        ranks.engines[rank].cache.drop_unlocked()  # this rank forgets L1 and L2; L3 stays
    elif fault == "lookup_fails":
        ranks.backends[rank].inject(StorageOp.EXISTS, FaultKind.ERROR, times=2)
    elif fault == "refuse":
        ranks.refusals[rank] += 1


def test_the_model_catches_a_rank_that_skips_a_request():
    """The header check: a rank whose waiting queue lacks a request stops every rank at once."""
    ranks = Ranks()
    try:
        tokens = PREFIXES[0] + SUFFIXES[0]
        for engine in ranks.engines[:2]:
            engine.add_request(tokens, PARAMS)
        with pytest.raises(AgreementError):
            ranks.step()
    finally:
        ranks.close()


def test_tp3_ranks_order_the_queue_by_the_agreed_hit_under_lpm():
    """Default mode, lpm: rank 0 and 1 hold both prefixes, rank 2 only the shorter one (its
    L3 lookups fail). Each rank alone would put the longer prefix first; all order by the MIN."""
    ranks = Ranks(deterministic=False, token_budget=32)
    try:
        for tokens in (PREFIXES[1] + [5], PREFIXES[0] + [5]):
            ranks.add(tokens)
            for _ in range(100):
                ranks.step()
                if not any(e.has_unfinished for e in ranks.engines):
                    break
        ranks.engines[2].cache.drop_unlocked()
        ranks.backends[2].inject(StorageOp.EXISTS, FaultKind.ERROR, times=-1)
        lookups_failed = ranks.faults_fired()["lookup_fails"]
        ranks.add(PREFIXES[0] + [5])  # rank 2 has this one again, the others still do
        for _ in range(100):
            ranks.step()
            if not any(e.has_unfinished for e in ranks.engines):
                break
        ranks.add(list(range(100, 300)))  # a long prompt takes the budget for several steps
        ranks.step()
        miss = ranks.add(list(range(1, 30)))
        longer = ranks.add(PREFIXES[1] + SUFFIXES[1])  # 64 cached on ranks 0, 1; 0 on rank 2
        shorter = ranks.add(PREFIXES[0] + SUFFIXES[1])  # 32 cached on every rank
        for _ in range(2):
            ranks.step()
        orders = [[(r.id, r.agreed_hit) for r in e.scheduler.waiting] for e in ranks.engines]
        assert orders == [[(shorter, 32), (miss, 0), (longer, 0)]] * SIZE
        local = [e.cache.peek(PREFIXES[1] + SUFFIXES[1]).device_hit_length for e in ranks.engines]
        assert local == [64, 64, 0]
        assert ranks.faults_fired()["lookup_fails"] > lookups_failed  # rank 2 did look, and failed
    finally:
        ranks.close()


def _run(ranks: Ranks, until, max_steps: int = 400) -> dict[int, tuple[int, ...]]:
    """Step every rank (checking they stay in step) until `until(answers)`; the answers."""
    answers: dict[int, tuple[int, ...]] = {}
    for _ in range(max_steps):
        results = ranks.step()
        states = [_state(engine) for engine in ranks.engines]
        assert all(s == states[0] for s in states), "ranks diverged"
        answers.update((o.request_id, o.tokens) for o in results[0])
        if until(answers):
            break
    return answers


def test_tp3_ranks_reach_every_request_of_a_long_queue_in_turn():
    """200 waiting requests, more than the agreement's slots: the first 40 wait for L3
    prefetches that hang on rank 1, the 160 behind them are admitted meanwhile (in turn: the
    window's rotating slots), and once the hang ends the 40 are answered too, each answer the
    cold one (deterministic mode: bit-identical)."""
    def tokens(seed: int, n: int) -> list[int]:
        return torch.randint(1, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()

    doc = tokens(1, 3 * PAGE)
    stalled = [doc + tokens(100 + i, 3) for i in range(40)]
    behind = [tokens(1000 + i, 8) for i in range(160)]
    cold = Ranks(device_pages=64)
    try:
        ids = [cold.add(p) for p in stalled + behind]
        want = _run(cold, lambda a: len(a) == len(ids))
        want = [want[i] for i in ids]
    finally:
        cold.close()
    ranks = Ranks(device_pages=64)
    try:
        ranks.add(doc + [5])  # the document's pages reach every rank's L3, then only L3
        _run(ranks, lambda a: len(a) == 1)
        for engine in ranks.engines:
            engine.cache.flush()
            engine.cache.storage.drain()
            engine.cache.drop_unlocked()
        ranks.backends[1].inject(StorageOp.GET, FaultKind.HANG, times=-1)
        stalled_ids = [ranks.add(p) for p in stalled]
        behind_ids = [ranks.add(p) for p in behind]
        got = _run(ranks, lambda a: set(behind_ids) <= set(a))
        assert set(behind_ids) <= set(got), "requests behind the stalled ones were starved"
        assert not set(stalled_ids) <= set(got), "the hang held none of them back"
        ranks.backends[1].clear()  # the hung reads fail: those requests are recomputed
        got.update(_run(ranks, lambda a: not any(e.has_unfinished for e in ranks.engines)))
        assert [got[i] for i in stalled_ids + behind_ids] == want
        for engine in ranks.engines:
            engine.cache.flush()
            engine.cache.storage.drain()
            audit = engine.cache.audit()
            assert audit.leaked_pages == 0 and audit.leaked_locks == 0, audit
            assert audit.open_prefetches == 0, audit
    finally:
        ranks.close()


def test_tp3_a_request_far_back_in_the_queue_ends_its_prefetch_and_is_ordered_by_its_hit():
    """A request behind 40 others (more than the agreement's slots) whose prefix only L3 holds:
    within a few steps every rank ends its finished prefetch (the pages join the tree in L2),
    its hit is agreed, and lpm puts it first."""
    ranks = Ranks(device_pages=40, deterministic=False, token_budget=32)
    try:
        ranks.add(PREFIXES[1] + [5])
        for _ in range(100):
            ranks.step()
            if not any(e.has_unfinished for e in ranks.engines):
                break
        for engine in ranks.engines:  # its pages: in L3 only
            engine.cache.flush()
            engine.cache.storage.drain()
            engine.cache.drop_unlocked()
        ranks.add([1 + i % 250 for i in range(399)])  # takes the whole budget for many steps
        ranks.step()
        misses = [ranks.add([200 + i, 3, 4]) for i in range(40)]
        hit = ranks.add(PREFIXES[1] + SUFFIXES[2])  # 64 tokens of it in L3
        for _ in range(8):  # the long prompt still runs
            ranks.step()
            if all(e.scheduler.waiting[0].id == hit for e in ranks.engines):
                break
        for engine in ranks.engines:
            first = engine.scheduler.waiting[0]
            assert first.id == hit and first.agreed_hit >= 64
            assert first.ticket is None and first.storage_hit >= 64
            assert engine.cache.peek(first.prompt).host_hit_length >= 64
            assert len(engine.scheduler.waiting) == len(misses) + 1  # nothing admitted yet
    finally:
        ranks.close()
