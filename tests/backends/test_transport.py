"""The transports between processes' registered memory (the prefill -> decode hand-off and
peer-to-peer L2 reads), one conformance suite for all three.

The side under test (prefill, say) lives in this process; the peer is in a process of its
own for the real libraries (tests/backends/transport_peer.py, NIXL over UCX tcp+cma, Mooncake
over TCP) and in this process for the simulated transport. Both sides hold a KV pool shaped
(2, L, pages, page_size, H, D) in bf16, so a page is 2 * L separate regions, followed by a
64 MiB bulk area for the large transfer. Most tests run once per direction (`op`): a write
pushes this side's pages into the peer's, a read pulls the peer's pages into this side's.

Measured throughput (write() against raw_write(), read() against raw_read(), 64 MiB in 2,048
scattered rows) is in the docstrings of backends/transport_nixl.py and
backends/transport_mooncake.py; the large-transfer test here prints both and asserts only a
lenient ratio, the machine being shared.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest
import torch

from kvtier.backends import transport_address
from kvtier.backends.transport_base import (TransportTimeout, TransportError,
                                            TransportUnavailable)
from kvtier.backends.transport_registry import open_endpoint
from kvtier.errors import CacheUsageError, ClosedError, ConfigError
from kvtier.netcheck import listening
from kvtier.policies import Transport

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from transport_peer import InProcessPeer, ProcessPeer  # noqa: E402

L, PAGES, PAGE_SIZE, H, D = 4, 48, 16, 2, 64
SHAPE = (2, L, PAGES, PAGE_SIZE, H, D)
REGION = PAGE_SIZE * H * D * 2  # bytes of one (kv, layer, page) region in bf16: 4 KiB
KV_BYTES = 2 * L * PAGES * REGION  # 3 MiB
BULK_ROWS, BULK_ROW = 2048, 32 * 1024
BULK_BYTES = BULK_ROWS * BULK_ROW  # 64 MiB
POOL_BYTES = KV_BYTES + BULK_BYTES
KINDS = ["simulated", "nixl", "mooncake"]
REAL = ["nixl", "mooncake"]
OPS = ["write", "read"]
COUNTED = {"write": ("bytes", "descriptors", "writes", "failures"),
           "read": ("read_bytes", "read_descriptors", "reads", "read_failures")}


def page_rows(base: int, pages: list[int]) -> np.ndarray:
    """(addr, nbytes) of every region of `pages` in a (2, L, PAGES, ...) pool, (kv, layer,
    page) order: a page is 2 * L separate regions."""
    kv_layer = np.arange(2 * L, dtype=np.uint64)[:, None]
    offsets = (kv_layer * PAGES + np.asarray(pages, np.uint64)[None, :]) * REGION
    addrs = base + offsets.reshape(-1)
    return np.stack([addrs, np.full(len(addrs), REGION, np.uint64)], axis=1)


def counted(counters, op: str) -> tuple[int, int, int, int]:
    """(bytes, descriptors, calls, failures) of `op` in an endpoint's TransportCounters."""
    return tuple(getattr(counters, field) for field in COUNTED[op])


def make_peer(kind: str):
    """The decode side: in this process for the simulated transport, a child process else."""
    cls = InProcessPeer if kind == "simulated" else ProcessPeer
    return cls(kind, POOL_BYTES, KV_BYTES)


def page_view(pool: np.ndarray, page: int) -> np.ndarray:
    """The bytes of one page of a KV pool given as uint8 bytes (its 2 * L regions)."""
    return pool[:KV_BYTES].reshape(2 * L, PAGES, REGION)[:, page]


def pools(side, peer) -> dict[str, np.ndarray]:
    """Copies of both KV pools as bytes: this side's ("local") and the peer's ("peer")."""
    return {"local": side.kv_bytes.copy(), "peer": peer.read()}


def move(side, peer, op: str, mine: list[int], theirs: list[int], timeout_s: float = 30,
         raw: bool = False):
    """`op` ("write" or "read", `raw`: "raw_write"...) between this side's pages `mine` and the
    peer's pages `theirs`, page i with page i; what the call returned."""
    call = getattr(side.endpoint, f"raw_{op}" if raw else op)
    return call(peer.address, page_rows(side.kv.data_ptr(), mine), page_rows(peer.base, theirs),
                timeout_s=timeout_s)


def assert_landed(op: str, before: dict, after: dict, mine: list[int],
                  theirs: list[int]) -> tuple[str, list[int]]:
    """Each source page of `op` (this side's for a write, the peer's for a read) now stands in
    its destination page, which held other bytes before; the source pool is unchanged.
    Returns the destination pool's name and pages."""
    pages = {"local": mine, "peer": theirs}
    src, dst = ("local", "peer") if op == "write" else ("peer", "local")
    for s, d in zip(pages[src], pages[dst]):
        assert not np.array_equal(page_view(before[dst], d), page_view(before[src], s)), (s, d)
        assert np.array_equal(page_view(after[dst], d), page_view(before[src], s)), (op, s, d)
    assert np.array_equal(after[src], before[src])
    return dst, pages[dst]


class Side:
    """The prefill side: one endpoint with its KV pool and bulk area registered."""

    def __init__(self, kind: str, bulk: bool = False):
        gen = torch.Generator().manual_seed(1)
        self.kv = torch.randn(SHAPE, generator=gen).to(torch.bfloat16)
        self.endpoint = open_endpoint(kind, "prefill-test")
        self.endpoint.register(self.kv.data_ptr(), self.kv.nbytes)
        if bulk:
            self.bulk = torch.randint(0, 256, (BULK_BYTES,), dtype=torch.uint8, generator=gen)
            self.endpoint.register(self.bulk.data_ptr(), self.bulk.nbytes)
        self.kv_bytes = self.kv.view(torch.uint8).reshape(-1).numpy()


@pytest.fixture(scope="module", params=KINDS)
def pair(request):
    if request.param != "simulated":
        pytest.importorskip("nixl._api" if request.param == "nixl" else "mooncake.engine")
    side, peer = Side(request.param, bulk=True), make_peer(request.param)
    yield side, peer
    side.endpoint.close()
    peer.shutdown()


# ---- moving pages --------------------------------------------------------------------
@pytest.mark.parametrize("op, mine, theirs", [("write", [3, 0, 7], [5, 6, 1]),
                                              ("read", [40, 41, 17], [20, 2, 33])], ids=OPS)
def test_scattered_pages_land_exactly_and_nothing_else_changes(pair, op, mine, theirs):
    side, peer = pair
    before, counters = pools(side, peer), side.endpoint.counters
    done = move(side, peer, op, mine, theirs)
    after = pools(side, peer)
    dst, dst_pages = assert_landed(op, before, after, mine, theirs)
    untouched = [p for p in range(PAGES) if p not in dst_pages]
    assert np.array_equal(after[dst].reshape(2 * L, PAGES, REGION)[:, untouched],
                          before[dst].reshape(2 * L, PAGES, REGION)[:, untouched])
    moved = len(mine) * 2 * L * REGION
    assert (done.bytes, done.descriptors) == (moved, len(mine) * 2 * L) and done.seconds > 0
    now, other = side.endpoint.counters, OPS[1 - OPS.index(op)]
    assert tuple(np.subtract(counted(now, op), counted(counters, op))) == \
        (moved, len(mine) * 2 * L, 1, 0)
    assert counted(now, other) == counted(counters, other)


@pytest.mark.parametrize("op, mine, theirs", [("write", [1, 2], [9, 10]),
                                              ("read", [42, 43], [21, 22])], ids=OPS)
def test_raw_calls_move_the_same_bytes_and_count_nothing(pair, op, mine, theirs):
    side, peer = pair
    before, counters = pools(side, peer), side.endpoint.counters
    seconds = move(side, peer, op, mine, theirs, raw=True)
    assert seconds > 0
    assert_landed(op, before, pools(side, peer), mine, theirs)
    assert side.endpoint.counters == counters


@pytest.mark.parametrize("op", OPS)
def test_64_mib_in_2048_scattered_rows(pair, op):
    """One write (read) of 2,048 descriptors (no per-descriptor limit): bulk row i here and row
    perm[i] of the peer's; then write() vs raw_write() (read() vs raw_read())."""
    side, peer = pair
    ep = side.endpoint
    perm = np.random.default_rng(OPS.index(op)).permutation(BULK_ROWS).astype(np.uint64)
    local = np.stack([side.bulk.data_ptr() + np.arange(BULK_ROWS, dtype=np.uint64) * BULK_ROW,
                      np.full(BULK_ROWS, BULK_ROW, np.uint64)], axis=1)
    remote = np.stack([peer.base + KV_BYTES + perm * BULK_ROW,
                       np.full(BULK_ROWS, BULK_ROW, np.uint64)], axis=1)
    def peer_rows():
        return peer.read(KV_BYTES, BULK_BYTES).reshape(BULK_ROWS, BULK_ROW)[perm.astype(np.int64)]

    mine = side.bulk.numpy().reshape(BULK_ROWS, BULK_ROW)
    assert not np.array_equal(peer_rows(), mine)
    done = getattr(ep, op)(peer.address, local, remote, timeout_s=60)
    assert (done.bytes, done.descriptors) == (BULK_BYTES, BULK_ROWS)
    assert np.array_equal(peer_rows(), mine)  # either way: the same bytes on both sides now
    calls, raws = [], []
    for _ in range(3):  # best of three each, alternating: the machine is shared
        calls.append(getattr(ep, op)(peer.address, local, remote, timeout_s=60).seconds)
        raws.append(getattr(ep, f"raw_{op}")(peer.address, local, remote, timeout_s=60))
    gbps = BULK_BYTES / min(calls) / 1e9, BULK_BYTES / min(raws) / 1e9
    print(f"\n{ep.kind}: {op} {gbps[0]:.2f} GB/s, raw {gbps[1]:.2f} GB/s")
    assert gbps[0] >= 0.5 * gbps[1], gbps  # lenient: the target (>= 0.8) is in the docstring


# ---- what the caller gets wrong ------------------------------------------------------
@pytest.mark.parametrize("op", OPS)
def test_mismatched_or_malformed_rows_are_caller_errors(pair, op):
    side, peer = pair
    ep, counters = side.endpoint, side.endpoint.counters
    call = getattr(ep, op)
    local, remote = page_rows(side.kv.data_ptr(), [0, 1]), page_rows(peer.base, [2, 3])
    short = remote.copy()
    short[3, 1] -= 2
    cases = [(local, short), (local, remote[:-1]), (local[:, :1], remote[:, :1]),
             (local.astype(np.float64), remote),
             (np.array([[12345, REGION]] * len(local), np.uint64), remote),  # unregistered
             (np.array([[side.kv.data_ptr() + KV_BYTES - 8, REGION]]), remote[:1])]  # past end
    for bad_local, bad_remote in cases:
        with pytest.raises(CacheUsageError):
            call(peer.address, bad_local, bad_remote, timeout_s=5)
    with pytest.raises(CacheUsageError, match="timeout_s"):
        call(peer.address, local, remote, timeout_s=0)
    assert ep.counters == counters  # a caller bug is not a transfer failure


@pytest.mark.parametrize("op, mine", [("write", 4), ("read", 44)], ids=OPS)
def test_rows_outside_the_peers_memory_fail_fast_and_the_endpoint_still_works(pair, op, mine):
    side, peer = pair
    ep, before, call = side.endpoint, pools(side, peer), getattr(side.endpoint, op)
    local = page_rows(side.kv.data_ptr(), [mine])
    past_end = page_rows(peer.base + POOL_BYTES - REGION // 2, [0])[:1]
    nowhere = np.array([[peer.base + 3 * POOL_BYTES, REGION]], np.uint64)
    failures = counted(ep.counters, op)[3]
    for remote in (past_end, nowhere):
        t0 = time.monotonic()
        with pytest.raises(TransportError, match="outside"):
            call(peer.address, local[:1], remote, timeout_s=5)
        assert time.monotonic() - t0 < 2
    # an address that claims more memory than the peer registered: the library itself refuses
    real = transport_address.decode(peer.address)
    inflated = real._replace(regions=((real.regions[0]._replace(nbytes=2 * POOL_BYTES)),))
    beyond = np.array([[peer.base + POOL_BYTES + REGION, REGION]], np.uint64)
    t0 = time.monotonic()
    with pytest.raises(TransportError):
        call(transport_address.encode(inflated), local[:1], beyond, timeout_s=5)
    assert time.monotonic() - t0 < 5
    assert counted(ep.counters, op)[3] == failures + 3
    assert all(np.array_equal(now, before[k]) for k, now in pools(side, peer).items())
    move(side, peer, op, [mine], [11])
    assert_landed(op, before, pools(side, peer), [mine], [11])


def test_addresses_that_are_not_a_peer_of_this_kind_are_refused(pair):
    side, peer = pair
    other = next(k for k in Transport if k != side.endpoint.kind)
    foreign = transport_address.decode(peer.address)._replace(kind=other)
    local, remote = page_rows(side.kv.data_ptr(), [5]), page_rows(peer.base, [12])
    for bad, why in [(b"", "not a transport"), (b"\x93garbage", "not a transport"),
                     (transport_address.encode(foreign), "same transport")]:
        with pytest.raises(TransportError, match=why):
            side.endpoint.write(bad, local, remote, timeout_s=5)
    side.endpoint.write(peer.address, local, remote, timeout_s=30)


# ---- peers that close, die or hang -----------------------------------------------------
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", REAL)
def test_a_hung_then_closed_peer_raises_within_the_timeout(kind, op):
    """A stopped peer: the first write (read) times out (TransportTimeout) and the endpoint still
    works once the peer runs again; after the peer closes its endpoint, calls fail at once."""
    pytest.importorskip("nixl._api" if kind == "nixl" else "mooncake.engine")
    side, peer = Side(kind), ProcessPeer(kind, KV_BYTES, KV_BYTES)
    try:
        peer.stop()  # every thread of it stopped
        t0 = time.monotonic()
        with pytest.raises(TransportTimeout):
            move(side, peer, op, [0], [0], timeout_s=1.0)
        assert time.monotonic() - t0 < 2.5
        os.kill(peer.pid, signal.SIGCONT)
        # other pages: a timed-out Mooncake call may still land its own once the peer runs
        before = pools(side, peer)
        move(side, peer, op, [1], [1])
        assert_landed(op, before, pools(side, peer), [1], [1])
        peer.close_endpoint()
        t0 = time.monotonic()
        with pytest.raises(TransportError):
            move(side, peer, op, [0], [0], timeout_s=5)
        assert time.monotonic() - t0 < 5.5
        assert counted(side.endpoint.counters, op)[3] == 2
    finally:
        peer.shutdown()
        side.endpoint.close()


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("kind", REAL)
def test_a_peer_that_died_fails_the_call_at_once(kind, op):
    pytest.importorskip("nixl._api" if kind == "nixl" else "mooncake.engine")
    side, peer = Side(kind), ProcessPeer(kind, KV_BYTES, KV_BYTES)
    try:
        move(side, peer, op, [2], [3])  # connected first
        peer.proc.kill()
        peer.proc.wait(timeout=30)
        for _ in range(2):
            t0 = time.monotonic()
            with pytest.raises(TransportError):
                move(side, peer, op, [2], [3], timeout_s=5)
            assert time.monotonic() - t0 < 5.5
    finally:
        peer.shutdown()
        side.endpoint.close()


class _FailingAgent:
    """A NIXL agent whose `transfer` (or, with "poll", its first `check_xfer_state` after a
    transfer that reports "PROC") raises; records the handles released."""

    def __init__(self, real, where: str):
        self.real, self.where, self.released = real, where, []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def transfer(self, handle, *args, **kwargs):
        if self.where == "transfer":
            raise RuntimeError("NIXL_ERR_BACKEND (injected in transfer)")
        self.real.transfer(handle, *args, **kwargs)
        return "PROC"

    def check_xfer_state(self, handle):
        raise RuntimeError("NIXL_ERR_BACKEND (injected in a poll)")

    def release_xfer_handle(self, handle):
        self.released.append(handle)
        return self.real.release_xfer_handle(handle)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("where", ["transfer", "poll"])
def test_a_nixl_error_in_a_transfer_fails_the_call_and_releases_its_handle(where, op):
    """Whatever NIXL raises once a transfer exists, the write (read) fails as a
    TransportError (never NIXL's own exception), its handle is released, and the
    endpoint goes on."""
    pytest.importorskip("nixl._api")
    side, peer = Side("nixl"), ProcessPeer("nixl", KV_BYTES, KV_BYTES)
    ep = side.endpoint
    try:
        move(side, peer, op, [0], [0])  # connected
        real = ep._agent
        ep._agent = failing = _FailingAgent(real, where)
        with pytest.raises(TransportError, match="injected"):
            move(side, peer, op, [1], [1], timeout_s=5)
        ep._agent = real
        assert len(failing.released) == 1 and ep._stuck == []
        assert counted(ep.counters, op)[3] == 1
        before = pools(side, peer)
        move(side, peer, op, [2], [2])
        assert_landed(op, before, pools(side, peer), [2], [2])
    finally:
        peer.shutdown()
        side.endpoint.close()


@pytest.mark.parametrize("op", OPS)
def test_a_closed_simulated_peer_is_refused(op):
    side, peer = Side("simulated"), InProcessPeer("simulated", KV_BYTES, KV_BYTES)
    peer.close_endpoint()
    for raw in (False, True):
        with pytest.raises(TransportError, match="closed"):
            move(side, peer, op, [0], [0], timeout_s=5, raw=raw)
    side.endpoint.close()


# ---- lifetime, listeners, setup --------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_two_endpoints_in_one_process_listen_where_documented_and_close_cleanly(kind):
    """NIXL: one listener per endpoint, on 127.0.0.1. Mooncake 0.3.13: two per endpoint whose
    address no option chooses, 0.0.0.0 (P2P handshake) and `::` (TCP data), peers told to dial
    127.0.0.1 (if this fails, update backends/transport_mooncake.py). Simulated: none.
    close() releases them all and is idempotent; a closed endpoint refuses calls."""
    if kind != "simulated":
        pytest.importorskip("nixl._api" if kind == "nixl" else "mooncake.engine")
    me = os.getpid()
    before = set(listening([me]))
    side, peer = Side(kind), InProcessPeer(kind, KV_BYTES, KV_BYTES)
    opened = set(listening([me])) - before
    hosts = sorted(listener.host for listener in opened)
    assert hosts == {"simulated": [], "nixl": ["127.0.0.1", "127.0.0.1"],
                     "mooncake": ["0.0.0.0", "0.0.0.0", "::", "::"]}[kind], opened
    if kind == "mooncake":
        assert transport_address.decode(peer.address).blob.startswith(b"127.0.0.1:")
    with side.endpoint as ep:
        ep.write(peer.address, page_rows(side.kv.data_ptr(), [6]), page_rows(peer.base, [7]),
                 timeout_s=30)
        assert np.array_equal(page_view(peer.read(), 7), page_view(side.kv_bytes, 6))
    peer.shutdown()
    ep.close()  # again: nothing happens
    assert set(listening([me])) - before == set()
    for op in OPS:
        with pytest.raises(ClosedError):
            getattr(ep, op)(peer.address, page_rows(side.kv.data_ptr(), [6]),
                            page_rows(peer.base, [7]), 5)
    with pytest.raises(ClosedError):
        ep.register(side.kv.data_ptr(), side.kv.nbytes)


@pytest.mark.parametrize("kind", KINDS)
def test_registration_is_idempotent_and_overlaps_are_refused(kind):
    if kind != "simulated":
        pytest.importorskip("nixl._api" if kind == "nixl" else "mooncake.engine")
    pool = torch.zeros(1 << 20, dtype=torch.uint8)
    with open_endpoint(kind, "reg-test") as ep:
        ep.register(pool.data_ptr(), pool.nbytes)
        ep.register(pool.data_ptr(), pool.nbytes)  # the same pool again: nothing happens
        regions = transport_address.decode(ep.address()).regions
        assert [(r.addr, r.nbytes, r.device) for r in regions] == \
            [(pool.data_ptr(), pool.nbytes, "cpu")]
        with pytest.raises(CacheUsageError, match="overlap"):
            ep.register(pool.data_ptr() + 4096, 4096)
        with pytest.raises(ConfigError):
            ep.register(pool.data_ptr(), pool.nbytes, device="gpu0")


@pytest.mark.parametrize("kind", KINDS)
def test_deregistered_memory_is_moved_no_more_and_may_be_registered_anew(kind):
    """deregister releases the transport's registration: a peer holding the old address
    fails to read there, this side's rows there are refused, and memory that overlapped
    it registers now. Deregistering what is not registered, or after close, does nothing."""
    if kind != "simulated":
        pytest.importorskip("nixl._api" if kind == "nixl" else "mooncake.engine")
    pool, mine = torch.arange(1 << 16, dtype=torch.int32), torch.zeros(1 << 16, dtype=torch.int32)
    rows = np.array([[pool.data_ptr(), 4096]], np.uint64)
    local = np.array([[mine.data_ptr(), 4096]], np.uint64)
    with open_endpoint(kind, "dereg-test") as ep, open_endpoint(kind, "dereg-peer") as peer:
        ep.register(pool.data_ptr(), pool.nbytes)
        peer.register(mine.data_ptr(), mine.nbytes)
        old = ep.address()
        peer.read(old, local, rows, 5)
        assert torch.equal(mine[:1024], pool[:1024])
        mine.zero_()
        ep.deregister(pool.data_ptr(), pool.nbytes)
        ep.deregister(pool.data_ptr(), pool.nbytes)  # not registered (any more): nothing
        assert transport_address.decode(ep.address()).regions == ()
        if kind == "nixl":  # in one process UCX reads over shared memory, unchecked
            assert ep._regs == {}  # NIXL's registration handle went
        else:
            with pytest.raises(TransportError):
                peer.read(old, local, rows, 5)
            assert not mine.any()
        with pytest.raises(CacheUsageError):
            ep.write(peer.address(), rows, local, 5)
        ep.register(pool.data_ptr() + 4096, 4096)  # overlapped the pool before
    ep.deregister(pool.data_ptr() + 4096, 4096)  # closed: nothing to do


def test_open_endpoint_checks_the_kind_and_the_simulated_one_refuses_gpu_memory():
    with pytest.raises(ConfigError, match="nixl, mooncake, simulated"):
        open_endpoint("rdma", "x")
    pool = torch.zeros(4096, dtype=torch.uint8)
    with open_endpoint(Transport.SIMULATED, "x") as ep:
        with pytest.raises(ConfigError, match="host memory only"):
            ep.register(pool.data_ptr(), pool.nbytes, device="cuda:0")
        assert transport_address.decode(ep.address()).regions == ()


@pytest.mark.parametrize("kind, module, package, other", [
    ("nixl", "nixl._api", "pip install nixl", "mooncake"),
    ("mooncake", "mooncake.engine", "mooncake-transfer-engine-non-cuda", "nixl")])
def test_a_missing_library_names_its_package_and_the_other_transport(monkeypatch, kind, module,
                                                                     package, other):
    monkeypatch.setitem(sys.modules, module, None)  # `import` of it now raises ImportError
    with pytest.raises(TransportUnavailable) as info:
        open_endpoint(kind, "missing")
    assert package in str(info.value) and f"use the {other} transport" in str(info.value)
