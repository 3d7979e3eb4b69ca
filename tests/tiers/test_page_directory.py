"""The L3 page directory without Ray: publication, leases, quotas, storage deletes, rebuild.

Quota evictions and deletes happen in eviction passes (page_eviction.run_pass), never inside
a call: tests run a pass where the service's background thread would."""
from __future__ import annotations

import os
import uuid

import msgpack
import pytest
import torch

from kvtier.errors import CacheUsageError, ConfigError
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.messages import (DirectoryStats, LeaseGrant, LookupRequest, LookupResult,
                             MessageError, MissingReport, NamespaceInfo, NamespaceSpec,
                             StoredReport)
from kvtier.policies import MemLayout, StorageBackendKind
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.page_eviction import run_pass
from kvtier.tiers.page_store import open_rank_backend

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class RecordingStore:
    """A PageStore that remembers deletes, lists what the test says, and knows if it was
    closed."""

    def __init__(self, info, listing=None, listable=True):
        self.info, self.listing, self.listable = info, listing or {}, listable
        self.deleted: list[str] = []
        self.closed = False

    def delete(self, hashes):
        self.deleted += hashes
        return len(hashes)

    def list_pages(self):
        return self.listing

    def reclaim_old_format(self):
        return 0

    def close(self):
        self.closed = True


def h(i: int, tag: str = "a") -> str:
    """Page hash number `i` of chain `tag` (one hex digit)."""
    return f"{tag}{i:063x}"


def chain(tag: str, n: int) -> list[str]:
    return [h(i, tag) for i in range(n)]


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def stores():
    return {}


@pytest.fixture
def directory(clock, stores):
    def factory(info):
        stores[info.namespace] = RecordingStore(info)
        return stores[info.namespace]
    with PageDirectory(factory, clock, pending_ttl_s=60.0, max_lease_s=30.0) as d:
        yield d


def spec(kv_heads=2, max_pages=0, tenant="", **kw) -> NamespaceSpec:
    return NamespaceSpec("org/model", tenant, "fp", StorageBackendKind.SIMULATED, {}, kv_heads,
                         max_pages, **kw)


def head(i: int, total: int = 2) -> HeadRange:
    """KV head `i` alone: what TP rank `i` of a one-head-per-rank writer owns."""
    return HeadRange(i, i + 1, total)


def publish(d, ns, hashes, kv_heads=2):
    out = []
    for i in range(kv_heads):
        out = d.report_stored(ns, hashes, head(i, kv_heads))
    return out


# ---- publication -------------------------------------------------------------------------

def test_a_page_is_published_only_after_every_head_is_stored(directory):
    ns = directory.register(spec(kv_heads=3)).namespace
    pages = chain("a", 3)
    assert directory.report_stored(ns, pages, head(0, 3)) == []
    assert directory.report_stored(ns, pages[:2], head(2, 3)) == []
    assert directory.lookup(ns, pages).hit_pages == 0
    assert directory.report_stored(ns, pages, head(1, 3)) == pages[:2]  # page 2 lacks head 2
    assert directory.lookup(ns, pages).hit_pages == 2
    assert directory.report_stored(ns, pages[2:], head(2, 3)) == pages[2:]
    assert directory.lookup(ns, pages + [h(9, "b")]).hit_pages == 3
    s = directory.stats(ns)
    assert (s.published_pages, s.pending_pages, s.hit_pages, s.miss_pages, s.lookups) == \
        (3, 0, 5, 5, 3)


def test_registration_is_idempotent_and_conflicts_are_errors(directory):
    info = directory.register(spec())
    assert directory.register(spec()) == info
    with pytest.raises(ConfigError, match="already registered"):
        directory.register(spec(kv_heads=4))
    with pytest.raises(CacheUsageError, match="not registered"):
        directory.lookup("nope", [])
    with pytest.raises(CacheUsageError, match="with 2 KV heads"):
        directory.report_stored(info.namespace, chain("a", 1), head(2, 3))
    with pytest.raises(CacheUsageError, match="64 lowercase hex"):
        directory.report_stored(info.namespace, ["xyz"], head(0))


def test_writers_of_any_tp_size_fill_pages_together(directory):
    """Heads, not ranks: a TP=1 writer publishes alone; TP=3 ranks and a TP=1 writer mix."""
    ns = directory.register(spec(kv_heads=3)).namespace
    whole = chain("a", 2)
    assert directory.report_stored(ns, whole, HeadRange.all_of(3)) == whole
    mixed = chain("b", 2)
    assert directory.report_stored(ns, mixed, head(1, 3)) == []
    assert directory.report_stored(ns, mixed[:1], HeadRange(0, 3, 3)) == mixed[:1]
    assert directory.lookup(ns, mixed).hit_pages == 1


def test_tenants_are_isolated(directory):
    a = directory.register(spec(tenant="tenant-a")).namespace
    b = directory.register(spec(tenant="tenant-b")).namespace
    assert a != b
    tokens = list(range(16))
    ka = KeyNamespace("org/model", "tenant-a", "fp").page_hashes(tokens, 4)
    kb = KeyNamespace("org/model", "tenant-b", "fp").page_hashes(tokens, 4)
    assert not set(ka) & set(kb)  # the same tokens never share a key across tenants
    publish(directory, a, ka)
    assert directory.lookup(a, ka).hit_pages == 4
    assert directory.lookup(b, ka).hit_pages == 0  # even A's exact keys miss in B
    assert directory.lookup(b, kb).hit_pages == 0


# ---- leases, quota, LRU ------------------------------------------------------------------

def test_leases_block_eviction_and_expire(directory, clock, stores):
    ns = directory.register(spec(max_pages=2)).namespace
    old = chain("a", 2)
    publish(directory, ns, old)
    grant = directory.lease(ns, old + [h(5, "f")], ttl_s=10)
    assert grant.pages == 2 and grant.lease_id
    new = chain("b", 2)
    assert publish(directory, ns, new) == new  # over the quota until the next pass
    assert stores[ns].deleted == []  # a call never deletes
    run_pass(directory)
    assert directory.lookup(ns, new).hit_pages == 0  # only leased pages are older: new ones go
    assert directory.lookup(ns, old).hit_pages == 2
    assert stores[ns].deleted == [new[1], new[0]]
    clock.now += 11  # the lease lapses
    publish(directory, ns, chain("c", 1))
    run_pass(directory)
    s = directory.stats(ns)
    assert (s.leases_expired, s.leases_active, s.published_pages) == (1, 0, 2)
    assert directory.lookup(ns, old).hit_pages == 1  # the prefix lost its tail first
    assert directory.release(grant.lease_id) is False  # already gone


def test_release_lets_eviction_proceed(directory, stores):
    ns = directory.register(spec(max_pages=1)).namespace
    publish(directory, ns, chain("a", 1))
    res = directory.lookup(ns, chain("a", 1), lease_ttl_s=5)
    assert res.hit_pages == 1 and res.lease_id
    publish(directory, ns, chain("b", 1))
    run_pass(directory)
    assert directory.lookup(ns, chain("b", 1)).hit_pages == 0  # evicted: "a" is leased
    assert directory.release(res.lease_id) is True
    assert directory.release(res.lease_id) is False
    assert publish(directory, ns, chain("b", 1)) == chain("b", 1)
    run_pass(directory)
    assert stores[ns].deleted == chain("b", 1) + chain("a", 1)
    assert directory.lookup(ns, chain("a", 1)).hit_pages == 0
    with pytest.raises(CacheUsageError, match="at most 30"):
        directory.lease(ns, chain("b", 1), ttl_s=31)


def test_quota_is_lru_across_instances_and_drops_chain_tails_first(directory, stores):
    ns = directory.register(spec(max_pages=4)).namespace
    a, b = chain("a", 2), chain("b", 2)
    publish(directory, ns, a)  # instance A
    publish(directory, ns, b)  # instance B
    assert directory.lookup(ns, a).hit_pages == 2  # A uses its prefix: B's is now older
    publish(directory, ns, chain("c", 1))  # a third instance writes one page
    run_pass(directory)
    assert stores[ns].deleted == [b[1]]  # B's tail goes first, never its head before it
    assert directory.lookup(ns, b).hit_pages == 1
    assert directory.lookup(ns, a).hit_pages == 2
    assert directory.stats(ns).evicted_pages == 1


def test_max_bytes_quota_needs_page_bytes():
    with pytest.raises(MessageError, match="page_bytes"):
        spec(max_bytes=1000)
    assert spec(max_bytes=1000, page_bytes=300).capacity_pages == 3
    assert spec(max_pages=2, max_bytes=1000, page_bytes=300).capacity_pages == 2


def test_pending_pages_of_a_vanished_writer_expire(directory, clock, stores):
    ns = directory.register(spec()).namespace
    directory.report_stored(ns, chain("a", 2), head(0))
    clock.now += 61
    directory.lookup(ns, chain("a", 2))
    s = directory.stats(ns)
    assert (s.pending_pages, s.expired_pending_pages, s.doomed_pages) == (0, 2, 2)
    assert stores[ns].deleted == []  # queued: deleted by the next pass, not by the lookup
    assert directory.report_stored(ns, chain("a", 2), head(1)) == []  # doomed: ignored till gone
    assert run_pass(directory).deleted == 2
    assert stores[ns].deleted == chain("a", 2)  # the orphaned parts are removed
    assert directory.stats(ns).doomed_pages == 0


def test_rebuild_publishes_complete_pages_and_keeps_partial_ones_pending(clock):
    pages = chain("a", 3)
    listing = {pages[0]: {0, 1}, pages[1]: {0, 1}, pages[2]: {1}}
    d = PageDirectory(lambda info: RecordingStore(info, listing), clock)
    ns = d.register(spec()).namespace
    assert d.rebuild(ns) == 2
    assert d.lookup(ns, pages).hit_pages == 2
    assert d.report_stored(ns, pages[2:], head(0)) == pages[2:]
    d2 = PageDirectory(lambda info: RecordingStore(info, listing, listable=False), clock)
    assert d2.rebuild(d2.register(spec()).namespace) == 0  # e.g. Mooncake: starts empty


# ---- real backends: deletes and listings -------------------------------------------------

def _fill(kind: str, options: dict, tenant: str, kv_heads: int, pages: list[str], ranks):
    """Store `pages` for `ranks` (rank r owns KV head r) with real rank clients, as the rank
    actors would."""
    info = NamespaceInfo("", NamespaceSpec("org/model", tenant, "fp", kind, options, kv_heads),
                         options)
    for rank in ranks:
        with HostPool(SPEC, 8, MemLayout.PAGE_HEAD) as pool, \
                open_rank_backend(info, head(rank, kv_heads)) as backend:
            pool.kv.copy_(torch.randn(pool.kv.shape))
            backend.register_pool("kv", pool)
            assert all(backend.set_from("kv", pages, list(range(len(pages)))).ok)
    return info


def _present(info, rank, pages) -> int:
    with HostPool(SPEC, 8, MemLayout.PAGE_HEAD) as pool, \
            open_rank_backend(info, head(rank, info.spec.kv_heads)) as b:
        b.register_pool("kv", pool)
        return b.exists(pages).usable_pages


@pytest.mark.parametrize("kind", ["simulated", "file"])
def test_eviction_deletes_every_ranks_objects_through_the_backend(kind, tmp_path, clock):
    options = {"seed": uuid.uuid4().int >> 65} if kind == "simulated" else {"root_dir": str(tmp_path)}
    pages = chain("a", 3)
    info = _fill(kind, options, "t", 2, pages, ranks=[0, 1])
    with PageDirectory(clock=clock) as d:
        ns = d.register(NamespaceSpec("org/model", "t", "fp", kind, options, 2, max_pages=2)).namespace
        assert d.rebuild(ns) == 3  # three listed, over the quota (2) until the next pass
        run_pass(d)
        assert d.stats(ns).evicted_pages == 1
        evicted = [p for p in pages if d.lookup(ns, [p]).hit_pages == 0]
        assert len(evicted) == 1
        for rank in (0, 1):
            assert _present(info, rank, evicted) == 0
            assert _present(info, rank, [p for p in pages if p not in evicted]) == 2
    if kind == "file":
        left = sorted(os.listdir(tmp_path / info.spec.namespace / "kv"))
        assert len(left) == 2 * 2 * 2 and not any(n.startswith(evicted[0]) for n in left)


@pytest.mark.parametrize("kind", ["simulated", "file", "nixl"])
def test_backends_list_pages_by_complete_ranks(kind, tmp_path):
    if kind == "nixl":
        pytest.importorskip("nixl")
    options = {"seed": uuid.uuid4().int >> 65} if kind == "simulated" else {"root_dir": str(tmp_path)}
    pages = chain("b", 3)
    info = _fill(kind, options, "t", 2, pages, ranks=[0])
    _fill(kind, options, "t", 2, pages[:2], ranks=[1])
    _fill(kind, options, "other", 2, pages, ranks=[0, 1])  # another tenant
    with open_rank_backend(info, head(0)) as backend:
        assert backend.capabilities.listable
        listing = backend.list_pages()
    assert listing == {pages[0]: {0, 1}, pages[1]: {0, 1}, pages[2]: {0}}  # heads, any owner
    if kind == "file":  # a lone K part is not a complete head
        os.unlink(tmp_path / info.spec.namespace / "kv" / f"{pages[0]}_h1_v")
        with open_rank_backend(info, head(1)) as backend:
            assert backend.list_pages()[pages[0]] == {0}


def test_rebuild_from_a_file_backend(tmp_path, clock):
    options = {"root_dir": str(tmp_path)}
    pages = chain("c", 4)
    _fill("file", options, "t", 2, pages, ranks=[0])
    _fill("file", options, "t", 2, pages[:3], ranks=[1])
    with PageDirectory(clock=clock) as d:  # a fresh directory: an actor after a restart
        ns = d.register(NamespaceSpec("org/model", "t", "fp", "file", options, 2)).namespace
        assert d.rebuild(ns) == 3
        assert d.lookup(ns, pages).hit_pages == 3
        assert d.stats(ns).pending_pages == 1
        assert d.stats(ns).rebuilt_pages == 3


def test_mooncake_is_not_listable():
    from kvtier.backends.registry import backend_class
    try:
        cls = backend_class("mooncake")
    except Exception as exc:  # noqa: BLE001 - not installed here
        pytest.skip(str(exc))
    assert cls.capabilities.listable is False


# ---- messages ----------------------------------------------------------------------------

RECORDS = [
    spec(max_pages=7),
    NamespaceSpec("m", backend=StorageBackendKind.FILE, options={"root_dir": "/tmp/x",
                                                                 "fsync": True}),
    NamespaceInfo("ns", spec(), {"seed": 3, "x": None}, 2),
    StoredReport("ns", 1, 3, tuple(chain("a", 2))),
    MissingReport("ns", tuple(chain("a", 2))),
    LookupRequest("ns", tuple(chain("b", 3)), 2.5),
    LookupResult("ns", 3, "abc-1"),
    LeaseGrant("abc-1", "ns", 3, 2.5),
    DirectoryStats("ns", *range(1, 15)),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_messages_round_trip(record):
    data = record.to_msgpack()
    assert isinstance(data, bytes)
    assert type(record).from_msgpack(data) == record


def _packed(**fields):
    return msgpack.packb(fields)


@pytest.mark.parametrize("cls, payload, match", [
    (StoredReport, b"\xc1garbage", "not a msgpack"),
    (StoredReport, "not bytes", "takes bytes"),
    (StoredReport, _packed(type="LookupResult", namespace="n", hit_pages=1), "expected a StoredReport"),
    (StoredReport, _packed(type="StoredReport", namespace="n", head_start="0", head_stop=1,
                           hashes=[]), "head_start"),
    (StoredReport, _packed(type="StoredReport", namespace="n", head_start=True, head_stop=1,
                           hashes=[]), "head_start"),
    (StoredReport, _packed(type="StoredReport", namespace="n", head_start=1, head_stop=1,
                           hashes=[]), "head_stop"),
    (StoredReport, _packed(type="StoredReport", namespace="n", head_start=0, head_stop=1,
                           hashes=["zz"]), "64 lower"),
    (StoredReport, _packed(type="StoredReport", namespace="n", head_start=0, head_stop=1),
     "missing"),
    (StoredReport, _packed(type="StoredReport", namespace="n", head_start=0, head_stop=1,
                           hashes=[], x=1), "unknown"),
    (StoredReport, _packed(type="StoredReport", namespace="n", tp_rank=0, hashes=[]),
     "unknown"),  # a peer of the old format: refused, never read as heads
    (LookupRequest, _packed(type="LookupRequest", namespace="n", hashes=[], lease_ttl_s=-1), "lease_ttl"),
    (NamespaceSpec, _packed(type="NamespaceSpec", model="m", backend="tape"), "not one of"),
    (NamespaceSpec, _packed(type="NamespaceSpec", model="../m"), "not allowed"),
    (NamespaceSpec, _packed(type="NamespaceSpec", model="m", options={"seed": [1]}), "options"),
    (NamespaceSpec, _packed(type="NamespaceSpec", model="m", options={"sed": 1},
                            backend="simulated"), "unknown key 'sed'"),
    (NamespaceInfo, _packed(type="NamespaceInfo", namespace="n", options={},
                            spec={"type": "NamespaceSpec", "model": 5}), "model"),
    (LookupResult, msgpack.packb([1, 2]), "expected a LookupResult"),
], ids=lambda v: v if isinstance(v, str) and len(v) < 30 else "")
def test_messages_reject_bad_payloads(cls, payload, match):
    with pytest.raises(MessageError, match=match):
        cls.from_msgpack(payload)
