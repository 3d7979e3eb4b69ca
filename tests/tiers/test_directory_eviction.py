"""One L3 eviction authority per namespace (no Ray): the directory decides, deletes run in
passes off its calls, rank clients never evict on their own, and a page deleted behind the
directory's back is a miss it learns from."""
from __future__ import annotations

import os
import random

import pytest
import torch
from cache_builder import directory_cache
from eventually import eventually
from test_page_directory import RecordingStore

from kvtier.backends.faulty import FaultKind, FaultyBackend, StorageOp
from kvtier.backends.file_object import object_bytes
from kvtier.backends.registry import create_backend
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.messages import MessageError, NamespaceInfo, NamespaceSpec
from kvtier.policies import MemLayout, StorageBackendKind
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.page_eviction import DeleteOutcome, run_pass
from kvtier.tiers.page_store import open_rank_backend, rank_target
from kvtier.tiers.reference_kv import serve_reference

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)
ONE_HEAD = HeadRange(0, 1, 1)  # the model has one KV head: a TP=1 rank owns it
DOC = list(range(100, 140))  # 10 pages
FILE_PAGE_BYTES = 2 * object_bytes(SPEC.page_part_bytes)  # K and V objects of one page


def h(i: int, tag: str = "a") -> str:
    return f"{tag}{i:063x}"


def sim_spec(options=None, **kw) -> NamespaceSpec:
    return NamespaceSpec("org/model", "", "fp", StorageBackendKind.SIMULATED, options or {}, 1,
                         **kw)


# ---- the quota: folded from the backend's own bound; rank clients never evict ---------------

def test_a_backends_own_bound_becomes_the_namespace_quota(tmp_path):
    opts = {"root_dir": str(tmp_path), "max_size_bytes": 5 * 1000}
    with pytest.raises(MessageError, match="set page_bytes"):
        NamespaceSpec("m", backend="file", options=opts)
    with pytest.raises(MessageError, match="set page_bytes"):
        NamespaceSpec("m", backend="nixl", options=opts)
    assert NamespaceSpec("m", backend="file", options=opts, page_bytes=1000).capacity_pages == 5
    assert NamespaceSpec("m", backend="file", options=opts, page_bytes=1000,
                         max_pages=3).capacity_pages == 3  # the tighter one
    assert sim_spec(options={"capacity_pages": 4}).capacity_pages == 4
    assert NamespaceSpec("m", backend="file", options={"root_dir": str(tmp_path)}
                         ).capacity_pages == 0


def test_a_rank_client_under_a_namespace_does_no_lru_deletes_of_its_own(tmp_path):
    opts = {"root_dir": str(tmp_path), "max_size_bytes": 2 * FILE_PAGE_BYTES}
    spec = NamespaceSpec("org/model", "t", "fp", "file", opts, page_bytes=FILE_PAGE_BYTES)
    assert spec.capacity_pages == 2  # the byte bound is the namespace's quota now
    info = NamespaceInfo(spec.namespace, spec, opts)
    pages = [h(i) for i in range(6)]
    with HostPool(SPEC, 6, MemLayout.PAGE_HEAD) as pool, \
            open_rank_backend(info) as rank:
        rank.register_pool("kv", pool)
        assert rank.set_from("kv", pages, list(range(6))).ok == [True] * 6
        assert rank.stats().evicted_pages == 0
        assert rank.exists(pages).usable_pages == 6  # three times the quota, all still there
    kv_dir = tmp_path / spec.namespace / "kv"
    assert len(os.listdir(kv_dir)) == 6 * 2
    # The same options on a backend used on its own keep its own LRU.
    with HostPool(SPEC, 6, MemLayout.PAGE_HEAD) as pool, \
            create_backend("file", rank_target(info), opts) as alone:
        alone.register_pool("kv", pool)
        assert alone.stats().evicted_pages == 4  # evicts to its bound at attach
        assert sum(alone.exists([p]).usable_pages for p in pages) == 2


# ---- passes: deletes off the calls, doomed pages, reattach -------------------------------

def test_calls_only_queue_and_a_pass_deletes():
    stores = {}

    def factory(info):
        return stores.setdefault(info.namespace, RecordingStore(info))
    d = PageDirectory(factory)
    ns = d.register(sim_spec(max_pages=2)).namespace
    assert d.report_stored(ns, [h(0), h(1), h(2)], ONE_HEAD) == [h(0), h(1), h(2)]
    assert d.pass_due and stores[ns].deleted == []
    # a chain's tail goes first: h(2) is unpublished now, its delete queued
    assert d.eviction_pass() == 1
    assert d.lookup(ns, [h(2)]).hit_pages == 0 and d.stats(ns).doomed_pages == 1
    assert stores[ns].deleted == []
    assert d.report_stored(ns, [h(2)], ONE_HEAD) == []  # doomed: a report is ignored until it is gone
    [batch] = d.take_deletes()
    assert batch.hashes == (h(2),) and d.take_deletes() == []  # in flight, not handed out twice
    stores[ns].listing = {h(i): {0} for i in range(3)}
    assert d.rebuild(ns) == 2  # a rebuild meanwhile lists it, and does not publish it either
    assert d.lookup(ns, [h(2)]).hit_pages == 0
    stores[ns].delete(list(batch.hashes))
    d.deletes_done([DeleteOutcome(batch.batch_id, 1)])
    assert d.stats(ns).doomed_pages == 0 and not d.pass_due
    assert d.report_stored(ns, [h(2)], ONE_HEAD) == [h(2)]  # written again after its delete: published


def test_delete_failures_are_counted_and_the_pages_may_come_back():
    class Failing(RecordingStore):
        def delete(self, hashes):
            raise OSError("read-only file system")
    d = PageDirectory(Failing)
    ns = d.register(sim_spec(max_pages=1)).namespace
    d.report_stored(ns, [h(0), h(1)], ONE_HEAD)
    assert run_pass(d) == (1, 0, 1)  # queued, deleted, failed
    s = d.stats(ns)
    assert (s.delete_failures, s.evicted_pages, s.doomed_pages, s.published_pages) == (1, 1, 0, 1)


def test_a_replaced_store_is_closed_only_after_its_deletes_returned():
    made = []

    def factory(info):
        made.append(RecordingStore(info))
        return made[-1]
    d = PageDirectory(factory)
    ns = d.register(sim_spec(max_pages=1)).namespace
    d.report_stored(ns, [h(0), h(1)], ONE_HEAD)
    d.eviction_pass()
    [batch] = d.take_deletes()
    d.reattach(ns, {})  # new storage while a delete runs on the old one
    assert batch.store is made[0] and not made[0].closed
    d.deletes_done([DeleteOutcome(batch.batch_id, 1)])
    assert made[0].closed and not made[1].closed
    d.close()
    assert made[1].closed


# ---- a page deleted behind the directory's back --------------------------------------------

def make_cache(directory, storage=None):
    return directory_cache(SPEC, directory, storage)


def serve(cache, tokens) -> int:
    """Prefetch (wait), look up, compute the rest, store; the L3 hit in tokens. The KV the
    cache hands back is checked against the reference: a hit is never wrong KV."""
    done = serve_reference(cache, tokens)
    assert done.kv_ok, "a hit returned KV that differs from recompute"
    return done.storage_hit


def settle(cache):
    cache.flush()
    cache.storage.drain()
    cache.flush()


@pytest.fixture
def file_namespace(tmp_path):
    """A directory over a real file backend, and the namespace a writer filled with DOC."""
    with PageDirectory() as d:
        probe = make_cache(None)
        ns = probe.namespace
        probe.close()
        info = d.register(NamespaceSpec(ns.model, ns.tenant_salt, ns.layout_fingerprint,
                                        "file", {"root_dir": str(tmp_path)}))
        with make_cache(d, open_rank_backend(info)) as writer:
            serve(writer, DOC)
            settle(writer)
        assert d.stats(info.namespace).published_pages == 10
        yield d, info, tmp_path / info.namespace / "kv"


def test_a_page_deleted_by_hand_is_a_miss_then_leaves_the_directory(file_namespace):
    d, info, kv_dir = file_namespace
    pages = info.spec.key_namespace.page_hashes(DOC, 4)
    os.unlink(kv_dir / f"{pages[4]}_h0_k")  # by hand: the directory is not told
    with make_cache(d, open_rank_backend(info)) as reader:
        assert serve(reader, DOC + [7]) == 4 * 4  # only what is really there: pages 0-3
        assert reader.storage.counters.directory_errors == 0
    s = d.stats(info.namespace)
    assert (s.vanished_pages, s.published_pages, s.doomed_pages) == (1, 9, 1)
    assert d.lookup(info.namespace, pages).hit_pages == 4  # no longer reported
    assert os.path.exists(kv_dir / f"{pages[4]}_h0_v")  # its remains wait for the pass
    run_pass(d)
    assert not os.path.exists(kv_dir / f"{pages[4]}_h0_v")
    with make_cache(d, open_rank_backend(info)) as again:  # a miss is counted once
        assert serve(again, DOC + [7]) == 4 * 4
    assert d.stats(info.namespace).vanished_pages == 1


@pytest.mark.parametrize("fault", [FaultKind.ERROR, FaultKind.HANG])
def test_a_read_that_failed_or_hung_says_nothing_of_the_page(file_namespace, fault):
    d, info, _ = file_namespace
    faulty = FaultyBackend(open_rank_backend(info), seed=random.getrandbits(16))
    faulty.inject(StorageOp.GET, fault, times=1)
    try:
        with make_cache(d, faulty) as reader:
            ticket = reader.prefetch(DOC + [7])
            assert ticket is not None
            # the read met its fault (a hang: before finish gives up on it, not after)
            eventually(lambda: faulty.faults.total == 1, 5, f"the read met its {fault.value}")
            if fault is FaultKind.ERROR:
                assert ticket.op._settled.wait(5)
            reader.finish_prefetch(ticket)  # a hang: finish gives up on it after a short wait
            faulty.release()
    finally:
        faulty.release()
    s = d.stats(info.namespace)
    assert (s.vanished_pages, s.published_pages) == (0, 10)
