"""The namespace service is its namespaces' one L3 eviction authority (no Ray): its background
pass evicts what the quota asks and deletes it outside the lock, so no lookup or report ever
waits on a delete."""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from cache_builder import directory_cache

from kvtier.actors.l3.namespace_actor import FakeNamespaceClient
from kvtier.backends.file_object import object_bytes
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.messages import NamespaceSpec
from kvtier.policies import StorageBackendKind
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.page_store import open_rank_backend
from kvtier.tiers.reference_kv import serve_reference

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)
ONE_HEAD = HeadRange(0, 1, 1)  # the model has one KV head: a TP=1 rank owns it
FILE_PAGE_BYTES = 2 * object_bytes(SPEC.page_part_bytes)  # K and V objects of one page
GUARD_S = 5.0  # a hang guard, not a timing threshold
DOC_A, DOC_B = list(range(100, 120)), list(range(300, 320))  # 5 pages each


def make_cache(directory, storage=None):
    return directory_cache(SPEC, directory, storage)


def serve(cache, tokens) -> int:
    """Prefetch (wait), look up (the KV handed back is checked), compute, store; L3 hit."""
    done = serve_reference(cache, tokens)
    assert done.kv_ok, "a hit returned KV that differs from recompute"
    cache.flush()
    cache.storage.drain()  # backups landed and reported
    return done.storage_hit


def test_two_instances_share_a_quota_and_one_background_pass_evicts_from_both_places(tmp_path):
    client = FakeNamespaceClient(sync_passes=False)  # passes on the service's thread only
    try:
        ns = make_cache(None).namespace
        quota = 6
        info = client.register(NamespaceSpec(
            ns.model, ns.tenant_salt, ns.layout_fingerprint, "file",
            {"root_dir": str(tmp_path), "max_size_bytes": quota * FILE_PAGE_BYTES},
            page_bytes=FILE_PAGE_BYTES))
        assert info.spec.capacity_pages == quota
        kv_dir = tmp_path / info.namespace / "kv"
        with make_cache(client, open_rank_backend(info)) as a, \
                make_cache(client, open_rank_backend(info)) as b:
            serve(a, DOC_A)  # instance A: 5 pages
            serve(b, DOC_B)  # instance B: 5 more, 4 over the shared quota
            assert client.service.wait_for_pass(30)
            for cache in (a, b):  # the writers' own clients evicted nothing
                assert cache.storage.backend.stats().evicted_pages == 0
        pages = ns.page_hashes(DOC_A, 4) + ns.page_hashes(DOC_B, 4)
        published = {p for p in pages if client.lookup(info.namespace, [p]).hit_pages}
        on_disk = {p for p in pages if os.path.exists(kv_dir / f"{p}_h0_k")
                   or os.path.exists(kv_dir / f"{p}_h0_v")}
        stats = client.stats(info.namespace)
        assert (stats.evicted_pages, stats.published_pages, stats.doomed_pages) == (4, quota, 0)
        assert published == on_disk and len(published) == quota  # gone from both, together
        assert len(os.listdir(kv_dir)) == 2 * quota
        assert set(pages[5:]) <= published  # least recently used first: A's pages went
        with make_cache(client, open_rank_backend(info)) as c:  # a third instance reads
            serve(c, DOC_A + [1])  # what is left of A, if anything: right KV either way
            assert serve(c, DOC_B + [1]) == len(DOC_B)
    finally:
        client.close()
    assert not client.service._evictor._thread.is_alive()  # close() stopped it


class BlockingStore:
    """A PageStore whose delete blocks until the test releases it."""

    listable = False

    def __init__(self, info):
        self.info = info
        self.entered, self.release = threading.Event(), threading.Event()
        self.deleted: list[str] = []

    def delete(self, hashes):
        self.entered.set()
        assert self.release.wait(60), "the test never released the delete"
        self.deleted += hashes
        return len(hashes)

    def list_pages(self):
        return {}

    def reclaim_old_format(self):
        return 0

    def close(self):
        self.release.set()


def h(i: int) -> str:
    return f"c{i:063x}"


def test_no_lookup_or_report_waits_on_a_delete():
    stores = []

    def factory(info):
        stores.append(BlockingStore(info))
        return stores[-1]
    client = FakeNamespaceClient(directory=PageDirectory(factory), sync_passes=False)
    calls = ThreadPoolExecutor(1)
    try:
        ns = client.register(NamespaceSpec("org/model", "", "fp", StorageBackendKind.SIMULATED,
                                           {}, 1, max_pages=2)).namespace
        store = stores[0]
        assert client.report_stored(ns, [h(0), h(1), h(2)], ONE_HEAD) == [h(0), h(1), h(2)]
        assert store.entered.wait(GUARD_S * 6), "the background pass never reached its delete"
        # The pass is inside store.delete now; the service must still answer every call.
        assert calls.submit(client.lookup, ns, [h(0), h(1), h(2)]).result(GUARD_S).hit_pages == 2
        assert calls.submit(client.report_stored, ns, [h(3)], ONE_HEAD).result(GUARD_S) == [h(3)]
        assert calls.submit(client.report_stored, ns, [h(2)],
                            ONE_HEAD).result(GUARD_S) == []  # doomed
        stats = calls.submit(client.stats, ns).result(GUARD_S)
        assert stats.doomed_pages >= 1 and stats.evicted_pages >= 1
        store.release.set()
        assert client.service.wait_for_pass(30)
        assert client.service.wait_for_pass(30)  # h(3) pushed one more over the quota
        stats = client.stats(ns)
        assert (stats.published_pages, stats.doomed_pages, stats.delete_failures) == (2, 0, 0)
        assert sorted(store.deleted) == sorted({h(0), h(1), h(2), h(3)} - {
            p for p in map(h, range(4)) if client.lookup(ns, [p]).hit_pages})
    finally:
        for store in stores:
            store.release.set()
        calls.shutdown()
        client.close()


def test_a_fake_client_converges_synchronously(tmp_path):
    """In-process users that want no thread in the picture: each call ends with a pass."""
    with FakeNamespaceClient() as client:
        spec = NamespaceSpec("org/model", "", "fp", "file", {"root_dir": str(tmp_path)},
                             max_pages=1)
        ns = client.register(spec).namespace
        client.report_stored(ns, [h(0), h(1)], ONE_HEAD)
        stats = client.stats(ns)
        assert (stats.published_pages, stats.evicted_pages, stats.doomed_pages) == (1, 1, 0)
