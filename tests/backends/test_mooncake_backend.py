"""The mooncake backend against a real mooncake_master on 127.0.0.1 (module-scoped)."""
from __future__ import annotations

import dataclasses
import os
import signal
import socket
import time

import numpy as np
import pytest
import torch
import xxhash
from eventually import eventually

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # before mooncake loads: INFO floods stderr
pytest.importorskip("mooncake.store")

from kvtier.backends.base import KV_POOL, PagePart, StorageTarget, StorageUnavailable  # noqa: E402
from kvtier.backends.mooncake_backend import PARKED_CLIENTS, MooncakeBackend  # noqa: E402
from kvtier.backends.mooncake_master import MooncakeMaster, free_port, port_open  # noqa: E402
from kvtier.keys import KeyNamespace, page_hashes  # noqa: E402
from kvtier.kv_spec import KVSpec  # noqa: E402
from kvtier.policies import MemLayout  # noqa: E402
from kvtier.storage_options import MiB, MooncakeOptions  # noqa: E402
from kvtier.tiers.host_pool import HostPool  # noqa: E402
from kvtier.netcheck import listening

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.bfloat16)
SMALL = dict(global_segment_size_bytes=16 * MiB, local_buffer_size_bytes=0)
_COUNTER = iter(range(1_000_000))


@pytest.fixture(scope="module")
def master():
    with MooncakeMaster() as m:
        yield m


def make(master, verify=False, model=None) -> MooncakeBackend:
    opts = MooncakeOptions(master_address=master.address, verify_checksums=verify, **SMALL)
    ns = KeyNamespace(model or f"mc-test-{next(_COUNTER)}", "t", "fp")
    return MooncakeBackend(opts, StorageTarget(ns))


def filled_pool(pages=16, seed=0) -> HostPool:
    pool = HostPool(SPEC, pages, MemLayout.PAGE_HEAD)
    gen = torch.Generator().manual_seed(seed)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(pool.kv.dtype))
    return pool


def keys(n, salt=0):
    return page_hashes(list(range(salt, salt + 4 * n)), 4)


def same(pool, a, b) -> bool:
    return all(torch.equal(pool.page_part_view(a, p), pool.page_part_view(b, p)) for p in (0, 1))


@pytest.fixture(scope="module")
def pair(master):
    """A writer and a reader backend over one master, each with its own pool.

    Shared by the tests below (a client's close takes ~1 s): each test uses its own keys and
    looks at counter deltas.
    """
    w = make(master)
    r = make(master, model=w.target.namespace.model)
    src, dst = filled_pool(seed=1), filled_pool(seed=2)
    w.register_pool(KV_POOL, src)
    r.register_pool(KV_POOL, dst)
    yield w, r, src, dst
    w.close()
    r.close()


def test_round_trip_is_byte_exact_across_clients(pair):
    w, r, src, dst = pair
    ks = keys(4)
    assert w.set_from(KV_POOL, ks, [3, 1, 4, 0]).ok == [True] * 4
    assert r.exists(ks).usable_pages == 4
    res = r.get_into(KV_POOL, ks, [10, 11, 12, 13])
    assert res.ok == [True] * 4 and res.bytes_moved == 4 * SPEC.page_bytes
    for s, d in zip([3, 1, 4, 0], [10, 11, 12, 13]):
        assert all(torch.equal(src.page_part_view(s, p), dst.page_part_view(d, p)) for p in (0, 1))
    assert w.capabilities.zero_copy and not w.capabilities.verified


def test_existing_objects_are_skipped_never_overwritten(pair):
    w, _, src, _ = pair
    k = keys(1, salt=50)
    original = src.page_part_view(0, 0).clone()
    assert w.set_from(KV_POOL, k, [0]).ok == [True]
    skipped = w.stats().write_skipped_existing
    src.page_part_view(0, 0).fill_(7)
    res = w.set_from(KV_POOL, k, [0])
    assert res.ok == [True] and res.bytes_moved == 0
    assert w.stats().write_skipped_existing == skipped + 1
    assert w.get_into(KV_POOL, k, [5]).ok == [True]
    assert torch.equal(src.page_part_view(5, 0), original)
    src.page_part_view(0, 0).copy_(original)


def test_missing_part_hides_the_page(pair):
    w, r, _, _ = pair
    ks = keys(3, salt=100)
    corrupt = r.stats().corrupt_objects
    w.set_from(KV_POOL, ks, [0, 1, 2])
    assert w.store.remove(w.target.object_name(KV_POOL, ks[1], 0, PagePart.V), True) == 0
    assert r.exists(ks).usable_pages == 1
    assert r.get_into(KV_POOL, ks, [5, 6, 7]).ok == [True, False, True]
    assert r.stats().corrupt_objects == corrupt  # absent is a miss, not corruption


@pytest.mark.parametrize("factor", [0.5, 2])
def test_wrong_size_object_is_a_miss_and_removed(pair, factor):
    w, r, src, _ = pair
    ks = keys(2, salt=200 + int(factor * 10))
    corrupt = r.stats().corrupt_objects
    w.set_from(KV_POOL, ks, [0, 1])
    name = w.target.object_name(KV_POOL, ks[1], 0, PagePart.K)
    assert w.store.remove(name, True) == 0
    size = int(SPEC.page_part_bytes * factor)  # page_head: K of pages 0 and 1 are adjacent
    assert w.store.batch_put_from([name], [src.page_part_view(0, 0).data_ptr()], [size]) == [0]
    assert r.get_into(KV_POOL, ks, [8, 9]).ok == [True, False]
    assert r.stats().corrupt_objects == corrupt + 1
    assert r.store.is_exist(name) == 0
    assert r.exists(ks).usable_pages == 1


_SCRATCH = []  # buffers registered with a client must outlive it


def _rewrite(store, name, change) -> None:
    """Object `name` replaced, through the raw client, by `change(its bytes)`."""
    size = store.get_size(name)
    buf = np.zeros(size, dtype=np.uint8)
    _SCRATCH.append(buf)
    assert store.register_buffer(buf.ctypes.data, size) == 0
    assert store.batch_get_into([name], [buf.ctypes.data], [size]) == [size]
    data = np.ascontiguousarray(change(buf))
    if data is not buf:
        _SCRATCH.append(data)
        assert store.register_buffer(data.ctypes.data, data.nbytes) == 0
    assert store.remove(name, True) == 0
    assert store.batch_put_from([name], [data.ctypes.data], [data.nbytes]) == [0]


def _flip(at):
    def change(buf):
        buf[at] ^= 0x01
        return buf
    return change


@pytest.mark.parametrize("factor", [0.5, 2])
def test_wrong_size_verified_object_is_a_miss_and_removed(master, factor):
    """Verified reads scatter an object into its part and its checksum: Mooncake fails one
    shorter than both (-800) or longer (-600); the master's size tells corruption apart."""
    with make(master, verify=True) as b:
        pool = filled_pool()
        b.register_pool(KV_POOL, pool)
        ks = keys(2, salt=220 + int(factor * 10))
        assert b.set_from(KV_POOL, ks, [0, 1]).ok == [True, True]
        name = b.target.object_name(KV_POOL, ks[1], 0, PagePart.K)
        _rewrite(b.store, name, lambda buf: np.resize(buf, int(buf.size * factor)))
        assert b.get_into(KV_POOL, ks, [8, 9]).ok == [True, False]
        assert b.stats().corrupt_objects == 1 and b.stats().extra["foreign_objects"] == 0
        assert b.store.is_exist(name) == 0
        assert b.exists(ks).usable_pages == 1


@pytest.mark.parametrize("damage", ["part_byte", "trailer_byte", "other_page"])
def test_checksums_turn_corrupt_bytes_into_a_miss(master, damage):
    """A verified object is its part's bytes and their xxh3_64: one flipped bit, in the part
    or in the checksum, or another page's bytes of the same size, is a corrupt object (a
    miss, counted, the page's objects removed), never wrong KV."""
    with make(master, verify=True) as b:
        pool = filled_pool()
        b.register_pool(KV_POOL, pool)
        assert b.capabilities.verified
        ks = keys(3, salt=300)
        assert b.set_from(KV_POOL, ks, [0, 1, 2]).ok == [True] * 3
        assert b.get_into(KV_POOL, ks, [8, 9, 10]).ok == [True] * 3
        assert same(pool, 0, 8) and same(pool, 2, 10)
        name = b.target.object_name(KV_POOL, ks[1], 0, PagePart.V)
        other = pool.page_part_view(5, 1).numpy()
        change = {"part_byte": _flip(17), "trailer_byte": _flip(-3),
                  "other_page": lambda buf: np.concatenate([other, buf[-8:]])}[damage]
        _rewrite(b.store, name, change)
        res = b.get_into(KV_POOL, ks, [11, 12, 13])
        assert res.ok == [True, False, True] and res.leading_ok == 1
        assert b.stats().corrupt_objects == 1
        assert b.exists(ks).usable_pages == 1  # the page's objects were dropped


def test_a_verified_object_is_the_part_then_its_xxh3(master):
    """The format other readers (and tools) see: part bytes, then xxh3_64 little-endian."""
    with make(master, verify=True) as b:
        pool = filled_pool()
        b.register_pool(KV_POOL, pool)
        k = keys(1, salt=320)
        assert b.set_from(KV_POOL, k, [4]).ok == [True]
        for part in (PagePart.K, PagePart.V):
            seen = []
            _rewrite(b.store, b.target.object_name(KV_POOL, k[0], 0, part),
                     lambda buf: seen.append(buf.copy()) or buf)
            raw, expected = seen[0], pool.page_part_view(4, int(part)).numpy()
            assert raw.size == SPEC.page_part_bytes + 8
            assert np.array_equal(raw[:-8], expected)
            assert int(raw[-8:].view("<u8")[0]) == xxhash.xxh3_64_intdigest(expected)


@pytest.mark.parametrize("writer_verifies", [True, False])
def test_a_reader_whose_verification_differs_from_the_writers_misses_cleanly(
        master, writer_verifies):
    """Verified objects are 8 bytes longer: a reader configured the other way finds every
    object 8 bytes off its size. That is a miss, counted in foreign_objects, not corruption:
    the objects stay for readers configured like their writer."""
    w = make(master, verify=writer_verifies)
    r = make(master, verify=not writer_verifies, model=w.target.namespace.model)
    with w, r:
        src, dst = filled_pool(seed=4), filled_pool(seed=5)
        w.register_pool(KV_POOL, src)
        r.register_pool(KV_POOL, dst)
        ks = keys(2, salt=340)
        assert w.set_from(KV_POOL, ks, [0, 1]).ok == [True, True]
        assert r.get_into(KV_POOL, ks, [2, 3]).ok == [False, False]
        assert r.stats().corrupt_objects == 0
        assert r.stats().extra["foreign_objects"] == 2 * 2  # K and V of each page
        assert w.get_into(KV_POOL, ks, [4, 5]).ok == [True, True]  # left in place
        assert same(src, 0, 4) and same(src, 1, 5)


def test_delete(pair):
    w, r, _, _ = pair
    ks = keys(3, salt=400)
    w.set_from(KV_POOL, ks, [0, 1, 2])
    assert r.exists(ks).usable_pages == 3  # leases the objects in Mooncake: delete still works
    assert w.delete(ks[1:2]) == 1
    assert w.exists(ks).usable_pages == 1
    assert w.delete(ks[1:2]) == 0


def test_host_pages_outside_the_pool_are_refused(pair):
    from kvtier.errors import CacheUsageError
    w, _, _, _ = pair
    with pytest.raises(CacheUsageError):
        w.set_from(KV_POOL, keys(1), [16])


def test_unreachable_master_fails_fast_with_advice():
    opts = MooncakeOptions(master_address=f"127.0.0.1:{free_port()}", **SMALL)
    start = time.monotonic()
    with pytest.raises(StorageUnavailable, match="cannot reach the Mooncake master"):
        MooncakeBackend(opts, StorageTarget(KeyNamespace("x", "t", "fp")))
    assert time.monotonic() - start < 30  # refused quickly, not after setup's ~90 s of retries


@pytest.mark.parametrize("binary, why", [("/nonexistent/mooncake_master", "not an executable"),
                                         ("/bin/false", "exited with code 1")])
def test_master_that_cannot_start_is_storage_unavailable(binary, why):
    with pytest.raises(StorageUnavailable, match=why):
        MooncakeMaster(start_timeout_s=5, binary=binary)


def test_own_master_listens_on_loopback_and_stops_at_close():
    b = MooncakeBackend(MooncakeOptions(**SMALL), StorageTarget(KeyNamespace("own", "t", "fp")))
    master = b.master
    addrs = [f"{l.host}:{l.port}" for l in listening([master.pid])]
    assert addrs and all(a.startswith("127.0.0.1:") for a in addrs), addrs
    assert b.store.get_hostname().startswith("127.0.0.1:")  # what peers are told to dial
    b.register_pool(KV_POOL, filled_pool())
    assert b.set_from(KV_POOL, keys(1), [0]).ok == [True]
    b.close()
    assert not master.alive() and master.proc.returncode is not None
    assert not port_open("127.0.0.1", master.rpc_port)
    with socket.socket() as s:  # the port is free again
        s.bind(("127.0.0.1", master.rpc_port))
    assert not os.path.exists(master.log_dir)


def test_master_death_turns_calls_into_misses():
    b = MooncakeBackend(MooncakeOptions(**SMALL), StorageTarget(KeyNamespace("dies", "t", "fp")))
    pool = filled_pool()
    b.register_pool(KV_POOL, pool)
    ks = keys(2, salt=500)
    assert b.set_from(KV_POOL, ks, [0, 1]).ok == [True, True]
    os.kill(b.master.pid, signal.SIGKILL)
    b.master.proc.wait(5)
    start = time.monotonic()
    assert b.exists(ks).usable_pages == 0
    assert b.get_into(KV_POOL, ks, [2, 3]).ok == [False, False]
    assert b.set_from(KV_POOL, keys(1, salt=600), [4]).ok == [False]
    assert b.delete(ks) == 0
    b.close()
    assert time.monotonic() - start < 30  # bounded: no hang
    assert PARKED_CLIENTS.stores()[-1] is b.store  # its close would retry the dead master


def test_lanes_that_see_the_master_fail_at_once_count_one_outage(caplog):
    """A batch's lanes report their calls' codes at once: a dead master is one outage and
    one error line, every failed RPC counted, and a good answer after it ends the outage."""
    import threading

    from kvtier.backends.mooncake_master_guard import MasterGuard
    extra: dict = {}
    guard = MasterGuard("127.0.0.1:1", None, lambda: 0, str, extra)
    start = threading.Barrier(3, timeout=10)

    def lane():
        start.wait()
        for _ in range(100):
            guard.observe([-900, -900])
    threads = [threading.Thread(target=lane) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert guard.down
    assert (extra["master_outages"], extra["rpc_failures"]) == (1, 300)
    assert len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
    guard.observe([0, 0])
    assert not guard.down


def test_remote_master_death_is_bounded(master):
    with MooncakeMaster() as doomed:
        b = make(doomed)
        b.register_pool(KV_POOL, filled_pool())
        ks = keys(1, salt=700)
        assert b.set_from(KV_POOL, ks, [0]).ok == [True]
        doomed.proc.kill()
        doomed.proc.wait(5)
        start = time.monotonic()
        for _ in range(3):  # misses from the first call on; one failed RPC pauses the rest
            assert b.get_into(KV_POOL, ks, [1]).ok == [False]
            assert b.set_from(KV_POOL, keys(1, salt=800), [2]).ok == [False]
            assert b.exists(ks).usable_pages == 0
        assert time.monotonic() - start < 30  # bounded: no hang
        b.close()
        assert time.monotonic() - start < 45  # bounded: no hang
        assert PARKED_CLIENTS.stores()[-1] is b.store  # parked, not closed (mooncake_parked)


def test_bench_measure_reports_every_field():
    from kvtier.bench.storage_mooncake import measure
    out = measure(2, repeats=1)
    for field in ("write_gbps", "read_gbps", "raw_write_gbps", "raw_read_gbps", "write_ratio",
                  "read_ratio", "exists_1000_ms", "unverified_read_ratio"):
        assert out[field] > 0
    assert out["page_bytes"] == 2 * 737_280 and out["pages"] == 2
    assert out["layout"] == "page_head" and out["objects_per_page"] == 6
    raw, plain, verified = (out["objects"][k]
                            for k in ("raw", "kvtier_unverified", "kvtier_verified"))
    assert raw["objects_per_page"] == plain["objects_per_page"] == 6
    assert verified["objects_per_page"] == 6  # the checksum rides in each object
    assert raw["bytes_per_object"] == plain["bytes_per_object"] == 737_280 // 3
    assert verified["bytes_per_object"] == 737_280 // 3 + 8
    assert (raw["write_calls_per_batch"], raw["read_calls_per_batch"]) == (1, 1)
    # An existence check, then the puts: 2 pages are under LANE_BYTES, so one lane, one call.
    assert plain["write_calls_per_batch"] == 2
    assert plain["read_calls_per_batch"] == 1
    assert all(d["write_objects_per_s"] > 0 and d["read_objects_per_s"] > 0
               for d in (raw, plain, verified))


def test_reads_are_verified_by_default():
    """A corrupt page must be a miss, never wrong KV: checksums are on unless turned off."""
    assert MooncakeOptions().verify_checksums is True
    assert MooncakeOptions(verify_checksums=False).verify_checksums is False


@pytest.mark.parametrize("bad", [0, -1, 601, "5", True, float("nan")])
def test_call_timeout_is_validated(bad):
    from kvtier.errors import ConfigError
    assert MooncakeOptions().call_timeout_s == 5.0
    with pytest.raises(ConfigError, match="call_timeout_s"):
        MooncakeOptions(call_timeout_s=bad)


def test_mooncakes_own_waits_follow_the_call_timeout_unless_the_environment_sets_them(
        monkeypatch):
    from kvtier.backends.mooncake_backend import MOONCAKE_TIMEOUT_ENV, bound_mooncake_waits
    for name in MOONCAKE_TIMEOUT_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MC_TCP_STATUS_TIMEOUT_SEC", "60")  # the operator's choice stands
    bound_mooncake_waits(2.5)  # whole seconds, rounded up
    assert {n: os.environ[n] for n in MOONCAKE_TIMEOUT_ENV} == {
        "MC_TCP_PROGRESS_TIMEOUT_SEC": "3", "MC_TCP_STATUS_TIMEOUT_SEC": "60",
        "MC_HANDSHAKE_CONNECT_TIMEOUT": "3"}


def test_master_binds_the_host_it_is_given():
    with MooncakeMaster(host="127.0.0.1") as m:
        assert m.host == "127.0.0.1" and m.address == f"127.0.0.1:{m.rpc_port}"
        assert {"--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1"} <= set(m.command())
        found = {(l.host, l.port) for l in listening([m.pid])}
        assert found == {("127.0.0.1", m.rpc_port), ("127.0.0.1", m.metrics_port)}, found


def test_master_refuses_an_address_this_node_does_not_have():
    # 198.51.100.0/24 is TEST-NET-2: no interface of a test machine has it.
    with pytest.raises(StorageUnavailable, match="cannot bind '198.51.100.7'.*master_host"):
        MooncakeMaster(start_timeout_s=5, host="198.51.100.7")


def test_own_master_binds_master_host():
    opts = MooncakeOptions(master_host="127.0.0.1", **SMALL)
    b = MooncakeBackend(opts, StorageTarget(KeyNamespace("own-host", "t", "fp")))
    try:
        assert b.master.host == "127.0.0.1" and b.master_address.startswith("127.0.0.1:")
    finally:
        b.close()


def test_what_a_client_listens_on(master):
    """Measured with Mooncake 0.3.13: a client (tcp, P2PHANDSHAKE) opens two listeners whose
    address no option chooses: the transfer engine's P2P handshake listener on 0.0.0.0 and
    the TcpTransport data listener on `::` (both in 15000-17000); local_hostname is only the
    address it registers. If this fails, Mooncake binds differently now: update the note in
    backends/mooncake_backend.py (and tighten this test)."""
    me = os.getpid()
    before = set(listening([me]))
    b = make(master)
    try:
        opened = set(listening([me])) - before
        assert b.store.get_hostname().startswith("127.0.0.1:")  # what peers are told to dial
        assert sorted(l.host for l in opened) == ["0.0.0.0", "::"], opened
        assert all(15000 <= l.port <= 17000 for l in opened), opened
    finally:
        b.close()


@pytest.mark.parametrize("verify", [False, True])
def test_one_batch_call_carries_every_heads_objects_of_many_pages(master, verify):
    """Per-head objects must not multiply the calls: with 3 KV heads and one lane, 5 pages
    are one put and one get of 5 x 3 x 2 objects (batch_put_from / batch_get_into, or
    verifying, their multi-buffer forms: part and checksum), read back byte for byte by a
    reader owning one head."""
    from kvtier.kv_spec import HeadRange

    spec3 = KVSpec(num_layers=2, num_kv_heads=3, head_dim=8, page_size=4, dtype=torch.bfloat16)
    opts = MooncakeOptions(master_address=master.address, verify_checksums=verify, **SMALL)
    ns = KeyNamespace(f"mc-test-{next(_COUNTER)}", "t", "fp")
    with MooncakeBackend(opts, StorageTarget(ns, HeadRange.all_of(3))) as w, \
            MooncakeBackend(opts, StorageTarget(ns, HeadRange(1, 2, 3))) as r, \
            HostPool(spec3, 8, MemLayout.PAGE_HEAD) as pool, \
            HostPool(dataclasses.replace(spec3, num_kv_heads=1), 8, MemLayout.PAGE_HEAD) as one:
        pool.kv.copy_(torch.randn(pool.kv.shape).to(pool.kv.dtype))
        w.register_pool(KV_POOL, pool)
        r.register_pool(KV_POOL, one)
        calls: list = []
        w.store = _CountingStore(w.store, calls)
        w.lane_count = 1
        ks = keys(5, salt=700 + verify)
        assert w.set_from(KV_POOL, ks, [0, 1, 2, 3, 4]).ok == [True] * 5
        assert w.get_into(KV_POOL, ks, [5, 6, 7, 0, 1]).ok == [True] * 5
        put, get = ("batch_put_from", "batch_get_into")
        if verify:
            put, get = put + "_multi_buffers", get + "_multi_buffers"
        assert calls == [(put, 5 * 3 * 2), (get, 5 * 3 * 2)]
        assert r.get_into(KV_POOL, ks[:2], [2, 3]).ok == [True, True]  # head 1 alone
        for src, dst in zip([5, 6], [2, 3]):
            assert all(torch.equal(pool.page_head_view(src, 1, p), one.page_head_view(dst, 0, p))
                       for p in (0, 1))


class _CountingStore:
    """The client, with its batch transfer calls recorded as (name, objects)."""

    def __init__(self, inner, calls: list) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name: str):
        attr = getattr(self._inner, name)
        if not name.startswith(("batch_put_from", "batch_get_into")):
            return attr

        def counted(names, *args):
            self._calls.append((name, len(names)))
            return attr(names, *args)
        return counted



def _batch(objects_per_page: list[int]):
    from kvtier.backends.mooncake_backend import _Batch
    b = _Batch([], [], [], [], [])
    for page, n in enumerate(objects_per_page):
        for _ in range(n):
            for column, value in zip(b, (page, "", 0, 100, 0)):
                column.append(value)
    return b


@pytest.mark.parametrize("pages", [[], [2], [2, 2], [2] * 10, [1, 2, 2, 1, 2, 2, 2],
                                   [2] * 2 + [1] * 9])
@pytest.mark.parametrize("lanes, call_bytes", [(3, float("inf")), (3, 200), (2, 350), (1, 100)])
def test_a_batch_splits_into_lanes_of_whole_pages_covering_every_object_once(pages, lanes,
                                                                            call_bytes):
    """`pages` lists each page's objects (of 100 bytes; a batch may miss some of a page's)."""
    b = _batch(pages)
    out = b.lanes(lanes, call_bytes)
    spans = [span for lane in out for span in lane]
    assert [o for lo, hi in spans for o in range(lo, hi)] == list(range(len(b.slots)))
    assert all(lo == 0 or b.slots[lo - 1] != b.slots[lo] for lo, _ in spans)  # whole pages
    assert 0 < len(out) <= min(lanes, len(pages)) or not pages
    assert all(lane for lane in out)
    for lo, hi in spans:  # a call ends with the first page that brings it to call_bytes
        last = min(i for i in range(lo, hi) if b.slots[i] == b.slots[hi - 1])
        assert sum(b.sizes[lo:last]) < call_bytes
    even = _batch([2] * 9).lanes(3, float("inf"))
    assert [sum(hi - lo for lo, hi in lane) for lane in even] == [6, 6, 6]


@pytest.mark.parametrize("pages, lanes", [(1, 1), (4, 1), (5, 2), (7, 2), (8, 3), (40, 3)])
def test_lanes_carry_at_least_lane_bytes_each(pages, lanes):
    """Pages of 200 bytes, lanes of at least 500: a batch under 1,000 bytes is one lane."""
    assert len(_batch([2] * pages).lanes(3, float("inf"), lane_bytes=500)) == lanes


def test_verified_batches_go_in_lanes_each_call_checked_on_its_own(master):
    """A verified batch goes in lanes of whole pages at once, each lane in calls of about
    `write_call_bytes` / `read_call_bytes`, each call hashed on its lane's thread; a corrupt
    object in one lane's middle call costs its page only."""
    import threading
    with make(master, verify=True) as b:
        pool = filled_pool(pages=24, seed=6)
        b.register_pool(KV_POOL, pool)
        b.lane_count, b.lane_bytes = 3, 0  # 10 pages: lanes of pages 0-3, 4-6, 7-9
        b.write_call_bytes, b.read_call_bytes = 2 * SPEC.page_bytes, SPEC.page_bytes
        calls: list = []
        b.store = _CountingStore(b.store, calls)
        m = b._maps[KV_POOL]
        hashed_on: dict = {}  # the batch's page -> the threads that hashed its objects
        seal, mismatched = m.seal, m.mismatched

        def seen(batch, objects):
            for i in objects:
                hashed_on.setdefault(batch.slots[i] - min(batch.slots), set()).add(
                    threading.get_ident())

        def seal_seen(batch, lo, hi):
            seen(batch, range(lo, hi))
            return seal(batch, lo, hi)

        def mismatched_seen(batch, objects):
            seen(batch, objects)
            return mismatched(batch, objects)

        def hashed_in_lanes() -> None:
            assert sorted(hashed_on) == list(range(10))
            lanes = [set().union(*(hashed_on[p] for p in pages))
                     for pages in (range(0, 4), range(4, 7), range(7, 10))]
            assert [len(threads) for threads in lanes] == [1, 1, 1]  # one thread a lane
            # the first lane on the caller's thread, the others on the pool's (whose one
            # thread may run both when the first lane it took ended quickly)
            assert lanes[0] == {threading.get_ident()}
            assert threading.get_ident() not in lanes[1] | lanes[2]
        m.seal, m.mismatched = seal_seen, mismatched_seen
        ks = keys(10, salt=360)
        assert b.set_from(KV_POOL, ks, list(range(10))).ok == [True] * 10
        assert sorted(calls) == sorted([("batch_put_from_multi_buffers", 2 * n)
                                        for n in (2, 2, 2, 1, 2, 1)])
        hashed_in_lanes()
        _rewrite(b.store._inner, b.target.object_name(KV_POOL, ks[5], 0, PagePart.K), _flip(5))
        hashed_on.clear()
        res = b.get_into(KV_POOL, ks, list(range(10, 20)))
        assert sorted(calls[6:]) == [("batch_get_into_multi_buffers", 2)] * 10
        hashed_in_lanes()
        assert res.ok == [i != 5 for i in range(10)]
        assert res.bytes_moved == 9 * SPEC.page_bytes
        assert b.stats().corrupt_objects == 1
        assert all(same(pool, i, 10 + i) for i in range(10) if i != 5)
        assert b.present(ks) == [i != 5 for i in range(10)]


@pytest.mark.parametrize("verify", [True, False])
def test_unverified_and_verified_lanes_round_trip_many_pages(master, verify):
    with make(master, verify=verify) as b:
        pool = filled_pool(pages=40, seed=7)
        b.register_pool(KV_POOL, pool)
        b.lane_bytes = 0  # these pages are small: lanes all the same
        b.read_call_bytes = b.write_call_bytes = 3 * SPEC.page_bytes
        calls: list = []
        b.store = _CountingStore(b.store, calls)
        ks = keys(20, salt=900 + verify)
        assert b.set_from(KV_POOL, ks, list(range(20))).ok == [True] * 20
        assert b.get_into(KV_POOL, ks, list(range(20, 40))).ok == [True] * 20
        assert all(same(pool, i, 20 + i) for i in range(20))
        # Lanes of 7, 7 and 6 pages: one call each, or verified, calls of up to 3 pages.
        assert len(calls) == 2 * (8 if verify else 3)
        assert sum(n for _, n in calls) == 2 * 2 * 20


def test_a_call_past_its_deadline_leaves_no_hash_running_and_stops_its_batch(master):
    """A lane's second put passes its deadline: the write raises PagesStillInUse, and by
    then no hashing of the batch still reads its pages and no lane starts another call."""
    import threading
    from concurrent.futures import Future

    from kvtier.backends.base import PagesStillInUse
    from kvtier.backends.bounded_calls import CallOutcome, CallState

    with make(master, verify=True) as b:
        b.register_pool(KV_POOL, filled_pool(pages=16))
        b.lane_count, b.lane_bytes = 2, 0
        b.write_call_bytes = SPEC.page_bytes  # lanes of 4 calls of 1 page
        m = b._maps[KV_POOL]
        seal, running, lock = m.seal, [0], threading.Lock()

        def slow_seal(*args):
            with lock:
                running[0] += 1
            time.sleep(0.2)
            seal(*args)
            with lock:
                running[0] -= 1
        m.seal = slow_seal
        run, puts = b.calls.run, []
        stuck = Future()
        ks = keys(8, salt=380)
        late = b.target.object_name(KV_POOL, ks[1], 0, PagePart.K)

        def run_or_time_out(fn, keep, call, *args):
            if _name(call) == "batch_put_from_multi_buffers":
                with lock:
                    puts.append(args[0][0])
                if args[0][0] == late:
                    return CallOutcome(CallState.TIMED_OUT, pending=stuck)
            return run(fn, keep, call, *args)
        b.calls.run = run_or_time_out
        with pytest.raises(PagesStillInUse) as caught:
            b.set_from(KV_POOL, ks, list(range(8)))
        assert running[0] == 0
        assert caught.value.pending is stuck
        assert late in puts and len(puts) < 8  # the other lane stopped early too
        assert b.stats().write_failures == 8


def test_calls_stuck_in_two_lanes_hold_the_pages_until_both_return(master):
    import threading
    from concurrent.futures import Future

    from kvtier.backends.base import PagesStillInUse
    from kvtier.backends.bounded_calls import CallOutcome, CallState

    with make(master, verify=False) as b:
        b.register_pool(KV_POOL, filled_pool(pages=8))
        b.lane_count, b.lane_bytes = 2, 0
        stuck, both_called = [Future(), Future()], threading.Barrier(2, timeout=10)

        def run(fn, keep, call, *args):
            both_called.wait()  # neither lane gives up before the other has called
            return CallOutcome(CallState.TIMED_OUT, pending=stuck[int(args[0][0] != first)])
        b.calls.run = run
        ks = keys(4, salt=420)
        first = b.target.object_name(KV_POOL, ks[0], 0, PagePart.K)
        with pytest.raises(PagesStillInUse) as caught:
            b.get_into(KV_POOL, ks, list(range(4)))
        pending = caught.value.pending
        assert pending is not None and not pending.done()
        stuck[1].set_result([])
        assert not pending.done()
        stuck[0].set_result([])
        assert pending.done()


def _name(fn) -> str:
    return getattr(fn, "__name__", "")



# ---- segments whose owner stops answering: deadlines and copies -------------------------
def _segment_client(master, **options) -> MooncakeBackend:
    """A client without a segment of its own: what it puts lands in the owners' segments."""
    opts = MooncakeOptions(master_address=master.address, global_segment_size_bytes=0,
                           local_buffer_size_bytes=0, call_timeout_s=1, **options)
    return MooncakeBackend(opts, StorageTarget(KeyNamespace(f"mc-seg-{next(_COUNTER)}", "t",
                                                            "fp")))


@pytest.fixture
def stopped_segment():
    """A master that keeps a silent client's segment mounted (a TTL of a minute, not 2 s:
    reads keep reaching it) and one segment owner in a child process."""
    from tests.backends.mooncake_segment import SegmentOwner

    with MooncakeMaster(client_ttl_s=60) as m:
        owner, = SegmentOwner.start(m.address)
        try:
            yield m, owner
        finally:
            owner.close()


def test_calls_to_a_stopped_segment_give_up_at_the_deadline(stopped_segment):
    """A host whose segment stops answering (SIGSTOP, as a cut link) must not hold its readers
    and writers: each call gives up after call_timeout_s (Mooncake alone waits 30 s for its
    TCP progress timeout, or a handshake timeout per object on a new connection). A read or
    write past its deadline raises PagesStillInUse with the call's Future (its pages may
    still be written: quarantined until it returns); at most two calls run past their
    deadline, later ones are not started; once the owner answers again everything works."""
    from kvtier.backends.base import PagesStillInUse

    m, owner = stopped_segment
    with _segment_client(m) as b:
        pool = filled_pool(pages=16)
        b.register_pool(KV_POOL, pool)
        b.lane_count = 1  # a call per op (lanes: the next test)
        ks = keys(4, salt=900)
        assert b.set_from(KV_POOL, ks, [0, 1, 2, 3]).ok == [True] * 4
        assert b.get_into(KV_POOL, ks, [4, 5, 6, 7]).ok == [True] * 4  # a connection is open
        before = dataclasses.replace(b.stats())
        owner.stop()
        start = time.monotonic()
        with pytest.raises(PagesStillInUse) as read:
            b.get_into(KV_POOL, ks, [8, 9, 10, 11])
        with pytest.raises(PagesStillInUse) as write:
            b.set_from(KV_POOL, keys(2, salt=950), [0, 1])
        with pytest.raises(StorageUnavailable, match="still running") as refused:
            b.get_into(KV_POOL, ks, [12, 13, 14, 15])
        assert not isinstance(refused.value, PagesStillInUse)  # never started: pages free
        assert b.exists(ks).usable_pages == 0  # a miss, at once
        assert time.monotonic() - start < 15
        stats = b.stats()
        assert stats.read_misses == before.read_misses + 8  # timed out, then not started
        assert stats.write_failures == before.write_failures + 2
        assert stats.extra["calls_timed_out"] == 2 and stats.extra["calls_stuck"] == 2
        assert not read.value.pending.done() or not write.value.pending.done()

        owner.resume()
        for call in (read.value.pending, write.value.pending):
            call.exception(timeout=60)  # returns (however it ended): its pages are free again
        eventually(lambda: b.calls.stuck == 0, 10, "the stuck calls were let go")
        eventually(lambda: b.get_into(KV_POOL, ks, [12, 13, 14, 15]).ok == [True] * 4, 60,
              "reads work again")
        assert all(same(pool, s, d) for s, d in zip([0, 1, 2, 3], [12, 13, 14, 15]))


def test_lanes_to_a_stopped_segment_stay_within_the_stuck_bound(stopped_segment):
    """A read in three lanes from a segment that stops answering: its calls give up at the
    deadline together, the read raises PagesStillInUse whose `pending` is done once all
    have returned, the next read is refused at once (two calls are stuck: MAX_STUCK_CALLS),
    and reads work again after."""
    from kvtier.backends.base import PagesStillInUse

    m, owner = stopped_segment
    with _segment_client(m) as b:
        pool = filled_pool(pages=16)
        b.register_pool(KV_POOL, pool)
        b.lane_bytes = 0  # these pages are small: three lanes all the same
        ks = keys(6, salt=960)
        assert b.set_from(KV_POOL, ks, list(range(6))).ok == [True] * 6
        assert b.get_into(KV_POOL, ks, list(range(6, 12))).ok == [True] * 6
        owner.stop()
        start = time.monotonic()
        try:
            with pytest.raises(PagesStillInUse) as read:
                b.get_into(KV_POOL, ks, list(range(6, 12)))
            assert time.monotonic() - start < 15
            stats = b.stats().extra
            assert stats["calls_stuck"] == stats["calls_timed_out"] == 3  # one call per lane
            with pytest.raises(StorageUnavailable, match="still running") as refused:
                b.get_into(KV_POOL, ks, list(range(6, 12)))
            assert not isinstance(refused.value, PagesStillInUse)  # never started
        finally:
            owner.resume()
        read.value.pending.exception(timeout=60)
        assert b.calls.stuck == 0
        eventually(lambda: b.get_into(KV_POOL, ks, list(range(6, 12))).ok == [True] * 6, 60,
                   "reads work again")
        assert all(same(pool, i, 6 + i) for i in range(6))


def test_a_quarantined_prefetch_settles_when_its_call_returns(stopped_segment, monkeypatch):
    """Through the storage worker: a prefetch and a backup whose calls passed the deadline
    fail without settling (their host pages stay quarantined; the backup is not handed back,
    so its L2 pages stay protected), and settle once the calls return."""
    from kvtier.backends.mooncake_backend import MOONCAKE_TIMEOUT_ENV
    from kvtier.tiers.storage_worker import OpState, StorageWorker

    # Mooncake's own waits well past the client's 1 s deadline, whichever backend of the
    # process came first (bound_mooncake_waits keeps the first's): with waits of 1 s, as
    # when this test runs alone, the stuck calls give up about at the deadline and settle
    # before the ops are checked
    for name in MOONCAKE_TIMEOUT_ENV:
        monkeypatch.setenv(name, "5")
    m, owner = stopped_segment
    with _segment_client(m) as b:
        b.register_pool(KV_POOL, filled_pool(pages=16))
        b.lane_count = 1  # a call per op: the read's call and the write's are both stuck
        ks = keys(2, salt=980)
        assert b.set_from(KV_POOL, ks, [0, 1]).ok == [True, True]
        worker = StorageWorker(b, batch_pages=8)
        try:
            owner.stop()
            read = worker.prefetch(ks, [2, 3])
            write = worker.backup(keys(2, salt=990), [4, 5])
            eventually(lambda: read.state.finished and write.state.finished, 30, "both ops ended")
            assert read.state is OpState.FAILED and read.quarantined and read.done_pages == 0
            assert write.state is OpState.FAILED and write.quarantined
            assert worker.finished_backups() == []  # held back: its pages stay protected
            owner.resume()
            eventually(lambda: read.settled and write.settled, 60, "the calls returned")
            assert worker.finished_backups() == [write] and write.done_pages == 0
        finally:
            owner.resume()
            worker.close()


def _replicas(b: MooncakeBackend, ks: list[str]) -> int:
    """Copies the master lists for every object of `ks`, summed."""
    names = b._names(b.pools[KV_POOL], ks)
    return sum(len(copies) for copies in b.store.batch_get_replica_desc(names).values())


def _waits_as_in_a_fresh_process(monkeypatch) -> None:
    """Mooncake's own waits left for the next client to set from its call_timeout_s, as in a
    process of its own: bound_mooncake_waits keeps the first backend's, and this module's
    first ones had 5 s, so a read stuck on a stopped owner held a test ~20 s, not ~4."""
    from kvtier.backends.mooncake_backend import MOONCAKE_TIMEOUT_ENV
    for name in MOONCAKE_TIMEOUT_ENV:
        monkeypatch.delenv(name, raising=False)


# copies=1 (the same run, the pages on the stopped owner missed) costs ~25 s more in the
# suite and shows what `stored` below already does: the copies are the difference.
@pytest.mark.parametrize("copies", [2])
def test_a_second_copy_serves_pages_whose_segment_owner_stopped(copies, monkeypatch):
    """Two segment owners; one stops. A read at once gives up at the deadline (Mooncake reads
    the first complete copy, with no fallback, and some first copies are on the stopped
    owner). Once the master drops its segment (its client's TTL, 2 s), pages written with
    replica_num=2 are all read from the other copy, byte for byte; with one copy the pages
    that lived there are misses, never errors or wrong bytes."""
    from kvtier.backends.base import PagesStillInUse
    from tests.backends.mooncake_segment import SegmentOwner

    _waits_as_in_a_fresh_process(monkeypatch)
    with MooncakeMaster() as m:
        owners = SegmentOwner.start(m.address, 2)
        try:
            with _segment_client(m, replica_num=copies) as b:
                assert b.copies == copies
                pool = filled_pool(pages=24, seed=3)
                b.register_pool(KV_POOL, pool)
                ks = keys(8, salt=1000)
                assert b.set_from(KV_POOL, ks, list(range(8))).ok == [True] * 8
                stored = _replicas(b, ks)
                assert stored == copies * 8 * 2  # K and V of each page
                owners[0].stop()
                try:  # quarantined from now on; on a loaded machine the master may have
                    # dropped the segment already (its 2-s TTL), and the read finds the rest
                    early = b.get_into(KV_POOL, ks, list(range(8, 16))).ok
                except PagesStillInUse:
                    early = None
                assert early is None or copies == 1 or early == [True] * 8, early
                eventually(lambda: _replicas(b, ks) < stored, 30, "the master dropped the segment")
                eventually(lambda: b.calls.stuck == 0, 60, "the read past its deadline returned")
                ok = b.get_into(KV_POOL, ks, list(range(16, 24))).ok
                # with one copy, some of the 24 objects were on the stopped owner (all on the
                # other one: a chance of 2^-24)
                assert ok == [True] * 8 if copies == 2 else sum(ok) < 8
                for i in (i for i, good in enumerate(ok) if good):
                    assert same(pool, i, 16 + i)
        finally:
            for owner in owners:
                owner.close()


def test_a_master_back_at_its_address_reuses_the_parked_client():
    """Restarted twice at one address, a master costs one client, not one per restart:
    each new backend takes the client parked when the master went (mooncake_parked.py)."""
    import subprocess
    with MooncakeMaster() as m:
        procs = [m.proc]
        try:
            b = make(m)
            first = b.store
            for round_ in range(2):
                b.register_pool(KV_POOL, filled_pool())
                assert b.set_from(KV_POOL, keys(1, salt=900 + round_), [0]).ok == [True]
                procs[-1].kill()
                procs[-1].wait(5)
                b.close()  # its master is gone: parked (whatever else earlier tests parked)
                assert any(store is first for store in PARKED_CLIENTS.stores())
                procs.append(subprocess.Popen(m.command(), stdout=subprocess.DEVNULL,
                                              stderr=subprocess.DEVNULL))
                eventually(lambda: port_open("127.0.0.1", m.rpc_port), 10, "the master listens")
                b = make(m)
                assert b.store is first  # taken back, no longer parked
                assert not any(store is first for store in PARKED_CLIENTS.stores())
            pool = filled_pool(seed=5)
            b.register_pool(KV_POOL, pool)
            assert b.set_from(KV_POOL, keys(1, salt=999), [0]).ok == [True]  # it works
            b.close()
        finally:
            for proc in procs[1:]:
                proc.kill()
                proc.wait(5)
