"""L3 through the cache facade: backup L2->L3, prefetch L3->L2 under each policy, detach."""
import random
import uuid

import pytest
import torch
from cache_builder import build_cache
from eventually import eventually

from kvtier.backends.base import StorageTarget
from kvtier.backends.faulty import FaultKind, FaultyBackend
from kvtier.backends.faulty import StorageOp as FaultOp
from kvtier.backends.registry import create_backend
from kvtier.config import HiCacheConfig
from kvtier.kv_spec import KVSpec
from kvtier.policies import HostMode, PrefetchPolicy, WritePolicy
from kvtier.tiers.reference_kv import serve_reference
from kvtier.tiers.storage_worker import OpState

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)


def make(seed, policy=WritePolicy.WRITE_THROUGH, prefetch=PrefetchPolicy.WAIT_COMPLETE,
         device_pages=32, threshold=8, host_mode=HostMode.CACHE, **sim):
    return build_cache(SPEC, device_pages, write_policy=policy, prefetch_policy=prefetch,
                       host_mode=host_mode, hicache_ratio=2.0,
                       prefetch_threshold_tokens=threshold, load_back_threshold_tokens=4,
                       storage_batch_pages=3, storage_backend="simulated",
                       storage_options={"seed": seed, **sim})


def serve(cache, tokens):
    """Prefetch (policy wait), lookup + load-back, compute the rest, store; five lengths."""
    done = serve_reference(cache, tokens)
    assert done.kv_ok, "a hit returned KV that differs from recompute"
    return done.lengths()


def settle(cache):
    cache.flush()
    cache.storage.drain()
    cache.flush()


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_instance_b_reuses_what_instance_a_computed(policy):
    seed = random.getrandbits(48)
    doc = list(range(100, 140))
    with make(seed, policy) as a:
        serve(a, doc)
        if policy is not WritePolicy.WRITE_THROUGH:
            serve(a, doc + [1])  # a second hit (selective) / nothing yet (write_back)
            serve(a, doc + [2])
            a.evict_device(10_000) if policy is WritePolicy.WRITE_BACK else None
        settle(a)
        assert a.storage.counters.backed_up_tokens >= 40
    with make(seed, policy) as b:  # a fresh instance: empty L1 and L2, same namespace
        lengths = serve(b, doc + [7, 7])
        assert lengths.storage_hit_length == 40
        assert lengths.host_loaded_length == 40 and lengths.extend_len == 2
        assert b.storage.counters.prefetched_tokens == 40


def test_prefix_below_threshold_is_not_fetched():
    seed = random.getrandbits(48)
    with make(seed, threshold=64) as a:
        serve(a, list(range(40)))
        settle(a)
    with make(seed, threshold=64) as b:
        assert b.prefetch(list(range(40))) is None
        assert b.storage.counters.unfulfilled_below_threshold_tokens == 40


def test_best_effort_takes_what_landed_and_frees_the_rest():
    seed = random.getrandbits(48)
    doc = list(range(200, 296))  # 24 pages, batches of 3
    with make(seed, device_pages=64) as a:
        serve(a, doc)
        settle(a)
    with make(seed, prefetch=PrefetchPolicy.BEST_EFFORT, device_pages=64) as b:
        ticket = b.prefetch(doc)
        assert not b.prefetch_ready(ticket) or ticket.op.state.finished  # not reached yet
        eventually(lambda: b.prefetch_ready(ticket, at_admission=True), WAIT_S,
                   "the prefetch was ready at admission")  # at most the batch in flight
        got = b.finish_prefetch(ticket)
        assert got % 12 == 0 and 0 <= got <= 96  # whole batches only
        b.flush()
        used = b.host_pool.allocator.num_used
        held = sum(len(n.host_value) for n in b.tree.nodes() if n.host_value is not None)
        assert used == held  # pages that did not land were freed
        lengths = serve(b, doc)  # prefetches the rest (waiting: no scheduler reaches it)
        assert lengths.storage_hit_length == 96 - got and lengths.extend_len == 0


def _best_effort_cache(seed, *docs):
    """A best_effort cache on a simulated L3 (batches of 3 pages) behind a fault injector,
    after another instance stored `docs` there."""
    with make(seed, device_pages=64) as a:
        for doc in docs:
            serve(a, doc)
        settle(a)
    b = build_cache(SPEC, 64, prefetch_policy=PrefetchPolicy.BEST_EFFORT,
                    prefetch_threshold_tokens=8, load_back_threshold_tokens=4,
                    storage_batch_pages=3, mem_layout="page_head")
    backend = FaultyBackend(create_backend("simulated", StorageTarget(b.namespace, b.heads),
                                           {"seed": seed}))
    b.attach_storage(backend)
    return b, backend


WAIT_S = 30.0  # hang guard only


def _running(ticket):
    eventually(lambda: ticket.op.state is OpState.RUNNING, WAIT_S,
               "the prefetch's first batch was taken up", interval_s=0.001)
    return ticket


def _ready_at_admission(b, ticket, timeout_s: float = WAIT_S) -> None:
    eventually(lambda: b.prefetch_ready(ticket, at_admission=True), timeout_s,
               "the prefetch was ready at admission", interval_s=0.005)


def _best_effort_behind_a_slow_read(seed, doc, fault, **fault_args):
    """`_best_effort_cache` whose reads carry `fault`; the prefetch of `doc` has its first
    batch in flight."""
    b, backend = _best_effort_cache(seed, doc)
    backend.inject(FaultOp.GET, fault, times=-1, **fault_args)
    return b, backend, _running(b.prefetch(doc))


def test_best_effort_at_admission_lands_the_batch_in_flight_and_starts_no_other():
    seed = random.getrandbits(48)
    doc = list(range(700, 796))  # 24 pages: 8 batches of 3
    b, backend, ticket = _best_effort_behind_a_slow_read(seed, doc, FaultKind.DELAY, delay_s=0.2)
    with b:
        b.storage.worker.read_s_per_page = 1.0  # reads here are slow: 0.2 s is not overdue
        assert not b.prefetch_ready(ticket, at_admission=True)  # its batch is still read
        _ready_at_admission(b, ticket)
        assert b.finish_prefetch(ticket) == 12  # the batch in flight, used
        assert backend.stats().pages_read == 3  # and no batch after it
        assert backend.faults.injected == {"get:delay": 1}  # that batch was the slow one
        assert b.storage.counters.unfulfilled_storage_transfer_tokens == 96 - 12


def test_best_effort_reached_before_its_first_batch_started_still_reads_that_batch():
    """Admission may reach a request within a millisecond of its prefetch's submission,
    before the worker has taken the first batch up: that batch is read and used."""
    seed = random.getrandbits(48)
    doc, other = list(range(1000, 1096)), list(range(1100, 1196))
    b, backend = _best_effort_cache(seed, doc, other)
    with b:
        backend.inject(FaultOp.GET, FaultKind.DELAY, times=1, delay_s=0.3)  # other's batch
        b.storage.worker.read_s_per_page = 1.0  # 0.3 s is not overdue here
        first = _running(b.prefetch(other))
        ticket = b.prefetch(doc)  # waits for the worker's turn behind other's first batch
        assert not b.prefetch_ready(ticket, at_admission=True)
        assert ticket.op.state is OpState.QUEUED
        _ready_at_admission(b, ticket)
        assert b.finish_prefetch(ticket) == 12  # its first batch, and no other
        b.abort_prefetch(first)
        assert backend.faults.injected == {"get:delay": 1}  # other's batch was the slow one


def test_best_effort_at_admission_goes_on_without_an_overdue_batch():
    seed = random.getrandbits(48)
    doc = list(range(800, 896))
    b, backend, ticket = _best_effort_behind_a_slow_read(seed, doc, FaultKind.HANG)
    with b:
        b.storage.worker.read_s_per_page = 0.001  # 3 pages are overdue after SETTLE_WAIT_S
        _ready_at_admission(b, ticket, timeout_s=5.0)  # goes on: does not wait out the hang
        assert b.finish_prefetch(ticket) == 0
        assert backend.faults.injected == {"get:hang": 1}
        assert b.storage.orphaned_pages == 24  # until the hung read returns
        backend.release()
        ticket.op._settled.wait(5.0)
        b.poll()
        assert b.storage.orphaned_pages == 0 and b.host_pool.allocator.num_used == 0


def test_timeout_policy_ends_the_wait():
    seed = random.getrandbits(48)
    doc = list(range(300, 340))
    with make(seed) as a:
        serve(a, doc)
        settle(a)
    with make(seed, prefetch=PrefetchPolicy.TIMEOUT) as b:
        ticket = b.prefetch(doc)
        assert ticket.timeout_s == pytest.approx(2.0 + 0.1 * 40 / 1024)
        assert b.storage.ready(ticket, now_s=ticket.op.submitted_s + 3.0)
        b.finish_prefetch(ticket)


def test_abort_and_detach_leak_nothing():
    seed = random.getrandbits(48)
    doc = list(range(400, 440))
    with make(seed) as a:
        serve(a, doc)
        settle(a)
    b = make(seed)
    t1 = b.prefetch(doc)
    b.abort_prefetch(t1)
    assert b.host_pool.allocator.num_used == 0
    t2 = b.prefetch(doc)
    b.detach_storage()  # drops the open prefetch
    assert t2.finished and b.host_pool.allocator.num_used == 0
    assert b.finish_prefetch(t2) == 0
    assert serve(b, doc).extend_len == 40  # serving goes on without L3
    b.close()


def test_tenants_never_hit_each_other():
    seed = random.getrandbits(48)
    doc = list(range(500, 540))
    config = HiCacheConfig(page_size=4, prefetch_threshold_tokens=8, storage_backend="simulated",
                           prefetch_policy="wait_complete", storage_options={"seed": seed})
    caches = [build_cache(SPEC, 32, config, tenant_salt=tenant) for tenant in ("alice", "bob")]
    alice, bob = caches
    serve(alice, doc)
    settle(alice)
    assert bob.prefetch(doc) is None
    assert serve(bob, doc).extend_len == 40
    for c in caches:
        c.close()


def test_a_run_split_while_backing_up_still_reaches_l3_whole():
    seed = random.getrandbits(48)
    doc = list(range(600, 640))
    with make(seed) as a:
        serve(a, doc + [1, 1, 1, 1])  # one node of 11 pages, its L2 copy in flight
        serve(a, doc + [2, 2, 2, 2])  # splits that node at page 10 before the copy is acked
        settle(a)
        assert all(n.storage_op == -1 for n in a.tree.nodes() if n.host_value is not None)
    with make(seed) as b:
        assert serve(b, doc + [3]).storage_hit_length == 40


def test_storage_only_stages_l2_and_uses_what_l3_brings():
    """host_mode=storage_only: L2 holds a page only while it moves between L1 and L3 (given
    back once stored), and L3 hits still come back through L2 into L1 (they used to be
    fetched and never loaded back)."""
    seed = random.getrandbits(48)
    doc = list(range(300, 340))
    with make(seed, host_mode=HostMode.STORAGE_ONLY) as cache:
        serve(cache, doc)
        settle(cache)
        assert cache.storage.counters.backed_up_tokens == 40
        assert cache.used_host_pages == 0 and cache.counters.unstaged_tokens == 40
        cache.evict_device(cache.device_pages)  # no L2 copy left: the run leaves the tree
        assert cache.peek(doc) == (0, 0)
        lengths = serve(cache, doc + [5])  # from L3, through L2, into L1
        assert lengths.storage_hit_length == 40 and lengths.host_loaded_length == 40
        settle(cache)
        assert cache.used_host_pages == 0  # the staged copies went back after the load
        assert cache.audit().leaked_pages == 0 and cache.audit().leaked_locks == 0


@pytest.mark.parametrize("mode", ["write_back", "storage_only"])
def test_pages_in_l1_are_never_read_from_l3_again(mode):
    """A prefetch starts past the deeper of the L1 and L2 matches. Under write_back and
    storage_only a computed run is in L1 only; it gets an L2 copy as the prefetch starts, so
    the L3 pages can hang below it, and only the pages past it are read."""
    seed = random.getrandbits(48)
    doc = list(range(900, 940))  # 10 pages
    kw = ({"policy": WritePolicy.WRITE_BACK} if mode == "write_back"
          else {"host_mode": HostMode.STORAGE_ONLY})
    with make(seed, **kw) as b:
        serve(b, doc[:12] + [1])  # L3 is empty: b computes 3 pages of doc
        settle(b)
        assert b.peek(doc) == (12, 0) and b.used_host_pages == 0  # in L1 only
        with make(seed) as a:  # another instance writes all of doc to L3
            serve(a, doc)
            settle(a)
        read_before = b.storage.backend.stats().pages_read
        lengths = serve(b, doc + [7])
        assert b.storage.backend.stats().pages_read - read_before == 7  # not 10
        assert (lengths.prefix_len, lengths.storage_hit_length) == (12, 28)
        assert (lengths.host_loaded_length, lengths.extend_len) == (28, 1)
        settle(b)
        assert b.audit().leaked_pages == 0 and b.audit().leaked_locks == 0
