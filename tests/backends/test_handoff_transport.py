"""The prefill -> decode KV handoff transports, one conformance suite for all three.

The writer (prefill side) lives in this process; the decode side is a peer in a process of its
own for the real libraries (tests/backends/handoff_peer.py, NIXL over UCX tcp+cma, Mooncake
over TCP) and in this process for the simulated transport. Both sides hold a KV pool shaped
(2, L, pages, page_size, H, D) in bf16, so a page is 2 * L separate regions, followed by a
64 MiB bulk area for the large transfer.

Measured throughput (write() against raw_write(), 64 MiB in 2,048 scattered rows) is in the
docstrings of backends/handoff_nixl.py and backends/handoff_mooncake.py; the large-transfer
test here prints both and asserts only a lenient ratio, the machine being shared.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest
import torch

from kvtier.backends import handoff_address
from kvtier.backends.handoff_base import (HandoffTimeout, HandoffTransferError,
                                          HandoffUnavailable)
from kvtier.backends.handoff_registry import open_endpoint
from kvtier.errors import CacheUsageError, ClosedError, ConfigError
from kvtier.netcheck import listening
from kvtier.policies import HandoffTransportKind

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
from handoff_peer import InProcessPeer, ProcessPeer  # noqa: E402

L, PAGES, PAGE_SIZE, H, D = 4, 48, 16, 2, 64
SHAPE = (2, L, PAGES, PAGE_SIZE, H, D)
REGION = PAGE_SIZE * H * D * 2  # bytes of one (kv, layer, page) region in bf16: 4 KiB
KV_BYTES = 2 * L * PAGES * REGION  # 3 MiB
BULK_ROWS, BULK_ROW = 2048, 32 * 1024
BULK_BYTES = BULK_ROWS * BULK_ROW  # 64 MiB
POOL_BYTES = KV_BYTES + BULK_BYTES
KINDS = ["simulated", "nixl", "mooncake"]
REAL = ["nixl", "mooncake"]


def page_rows(base: int, pages: list[int]) -> np.ndarray:
    """(addr, nbytes) of every region of `pages` in a (2, L, PAGES, ...) pool, (kv, layer,
    page) order: a page is 2 * L separate regions."""
    kv_layer = np.arange(2 * L, dtype=np.uint64)[:, None]
    offsets = (kv_layer * PAGES + np.asarray(pages, np.uint64)[None, :]) * REGION
    addrs = base + offsets.reshape(-1)
    return np.stack([addrs, np.full(len(addrs), REGION, np.uint64)], axis=1)


def make_peer(kind: str):
    """The decode side: in this process for the simulated transport, a child process else."""
    cls = InProcessPeer if kind == "simulated" else ProcessPeer
    return cls(kind, POOL_BYTES, KV_BYTES)


def page_view(pool: np.ndarray, page: int) -> np.ndarray:
    """The bytes of one page of a KV pool given as uint8 bytes (its 2 * L regions)."""
    return pool[:KV_BYTES].reshape(2 * L, PAGES, REGION)[:, page]


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
def test_scattered_pages_land_exactly_and_nothing_else_changes(pair):
    side, peer = pair
    before, counters = peer.read(), side.endpoint.counters
    src, dst = [3, 0, 7], [5, 6, 1]
    local, remote = page_rows(side.kv.data_ptr(), src), page_rows(peer.base, dst)
    done = side.endpoint.write(peer.address, local, remote, timeout_s=30)
    after = peer.read()
    for s, d in zip(src, dst):
        assert np.array_equal(page_view(after, d), page_view(side.kv_bytes, s)), (s, d)
    untouched = [p for p in range(PAGES) if p not in dst]
    assert np.array_equal(after.reshape(2 * L, PAGES, REGION)[:, untouched],
                          before.reshape(2 * L, PAGES, REGION)[:, untouched])
    moved = len(src) * 2 * L * REGION
    assert (done.bytes, done.descriptors) == (moved, len(src) * 2 * L) and done.seconds > 0
    now = side.endpoint.counters
    assert (now.bytes - counters.bytes, now.descriptors - counters.descriptors,
            now.writes - counters.writes, now.failures - counters.failures) == \
        (moved, len(src) * 2 * L, 1, 0)


def test_raw_write_moves_the_same_bytes_and_counts_nothing(pair):
    side, peer = pair
    counters = side.endpoint.counters
    seconds = side.endpoint.raw_write(peer.address, page_rows(side.kv.data_ptr(), [1, 2]),
                                      page_rows(peer.base, [9, 10]), timeout_s=30)
    after = peer.read()
    assert seconds > 0
    assert np.array_equal(page_view(after, 9), page_view(side.kv_bytes, 1))
    assert np.array_equal(page_view(after, 10), page_view(side.kv_bytes, 2))
    assert side.endpoint.counters == counters


def test_64_mib_in_2048_scattered_rows(pair):
    """One write of 2,048 descriptors (no per-descriptor limit), then write() vs raw_write()."""
    side, peer = pair
    perm = np.random.default_rng(0).permutation(BULK_ROWS).astype(np.uint64)
    local = np.stack([side.bulk.data_ptr() + np.arange(BULK_ROWS, dtype=np.uint64) * BULK_ROW,
                      np.full(BULK_ROWS, BULK_ROW, np.uint64)], axis=1)
    remote = np.stack([peer.base + KV_BYTES + perm * BULK_ROW,
                       np.full(BULK_ROWS, BULK_ROW, np.uint64)], axis=1)
    done = side.endpoint.write(peer.address, local, remote, timeout_s=60)
    assert (done.bytes, done.descriptors) == (BULK_BYTES, BULK_ROWS)
    landed = peer.read(KV_BYTES, BULK_BYTES).reshape(BULK_ROWS, BULK_ROW)
    assert np.array_equal(landed[perm.astype(np.int64)],
                          side.bulk.numpy().reshape(BULK_ROWS, BULK_ROW))
    writes, raws = [], []
    for _ in range(3):  # best of three each, alternating: the machine is shared
        writes.append(side.endpoint.write(peer.address, local, remote, timeout_s=60).seconds)
        raws.append(side.endpoint.raw_write(peer.address, local, remote, timeout_s=60))
    gbps = BULK_BYTES / min(writes) / 1e9, BULK_BYTES / min(raws) / 1e9
    print(f"\n{side.endpoint.kind}: write {gbps[0]:.2f} GB/s, raw {gbps[1]:.2f} GB/s")
    assert gbps[0] >= 0.5 * gbps[1], gbps  # lenient: the target (>= 0.8) is in the docstring


# ---- what the caller gets wrong ------------------------------------------------------
def test_mismatched_or_malformed_rows_are_caller_errors(pair):
    side, peer = pair
    ep, counters = side.endpoint, side.endpoint.counters
    local, remote = page_rows(side.kv.data_ptr(), [0, 1]), page_rows(peer.base, [2, 3])
    short = remote.copy()
    short[3, 1] -= 2
    cases = [(local, short), (local, remote[:-1]), (local[:, :1], remote[:, :1]),
             (local.astype(np.float64), remote),
             (np.array([[12345, REGION]] * len(local), np.uint64), remote),  # unregistered
             (np.array([[side.kv.data_ptr() + KV_BYTES - 8, REGION]]), remote[:1])]  # past end
    for bad_local, bad_remote in cases:
        with pytest.raises(CacheUsageError):
            ep.write(peer.address, bad_local, bad_remote, timeout_s=5)
    with pytest.raises(CacheUsageError, match="timeout_s"):
        ep.write(peer.address, local, remote, timeout_s=0)
    assert ep.counters == counters  # a caller bug is not a transfer failure


def test_rows_outside_the_peers_memory_fail_fast_and_the_endpoint_still_works(pair):
    side, peer = pair
    ep, before = side.endpoint, peer.read()
    local = page_rows(side.kv.data_ptr(), [4])
    past_end = page_rows(peer.base + POOL_BYTES - REGION // 2, [0])[:1]
    nowhere = np.array([[peer.base + 3 * POOL_BYTES, REGION]], np.uint64)
    failures = ep.counters.failures
    for remote in (past_end, nowhere):
        t0 = time.monotonic()
        with pytest.raises(HandoffTransferError, match="outside"):
            ep.write(peer.address, local[:1], remote, timeout_s=5)
        assert time.monotonic() - t0 < 2
    # an address that claims more memory than the peer registered: the library itself refuses
    real = handoff_address.decode(peer.address)
    inflated = real._replace(regions=((real.regions[0]._replace(nbytes=2 * POOL_BYTES)),))
    beyond = np.array([[peer.base + POOL_BYTES + REGION, REGION]], np.uint64)
    t0 = time.monotonic()
    with pytest.raises(HandoffTransferError):
        ep.write(handoff_address.encode(inflated), local[:1], beyond, timeout_s=5)
    assert time.monotonic() - t0 < 5
    assert ep.counters.failures == failures + 3
    assert np.array_equal(peer.read(), before)
    ep.write(peer.address, local, page_rows(peer.base, [11]), timeout_s=30)
    assert np.array_equal(page_view(peer.read(), 11), page_view(side.kv_bytes, 4))


def test_addresses_that_are_not_a_peer_of_this_kind_are_refused(pair):
    side, peer = pair
    other = next(k for k in HandoffTransportKind if k != side.endpoint.kind)
    foreign = handoff_address.decode(peer.address)._replace(kind=other)
    local, remote = page_rows(side.kv.data_ptr(), [5]), page_rows(peer.base, [12])
    for bad, why in [(b"", "not a handoff"), (b"\x93garbage", "not a handoff"),
                     (handoff_address.encode(foreign), "same handoff transport")]:
        with pytest.raises(HandoffTransferError, match=why):
            side.endpoint.write(bad, local, remote, timeout_s=5)
    side.endpoint.write(peer.address, local, remote, timeout_s=30)


# ---- peers that close, die or hang -----------------------------------------------------
@pytest.mark.parametrize("kind", REAL)
def test_a_hung_then_closed_peer_raises_within_the_timeout(kind):
    """A stopped peer: the first write times out (HandoffTimeout) and the endpoint still works
    once the peer runs again; after the peer closes its endpoint, writes fail at once."""
    pytest.importorskip("nixl._api" if kind == "nixl" else "mooncake.engine")
    side, peer = Side(kind), ProcessPeer(kind, KV_BYTES, KV_BYTES)
    local, remote = page_rows(side.kv.data_ptr(), [0]), page_rows(peer.base, [0])
    try:
        os.kill(peer.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(HandoffTimeout):
            side.endpoint.write(peer.address, local, remote, timeout_s=1.0)
        assert time.monotonic() - t0 < 2.5
        os.kill(peer.pid, signal.SIGCONT)
        side.endpoint.write(peer.address, local, page_rows(peer.base, [1]), timeout_s=30)
        assert np.array_equal(page_view(peer.read(), 1), page_view(side.kv_bytes, 0))
        peer.close_endpoint()
        t0 = time.monotonic()
        with pytest.raises(HandoffTransferError):
            side.endpoint.write(peer.address, local, remote, timeout_s=5)
        assert time.monotonic() - t0 < 5.5
        assert side.endpoint.counters.failures == 2
    finally:
        peer.shutdown()
        side.endpoint.close()


@pytest.mark.parametrize("kind", REAL)
def test_a_peer_that_died_fails_the_write_at_once(kind):
    pytest.importorskip("nixl._api" if kind == "nixl" else "mooncake.engine")
    side, peer = Side(kind), ProcessPeer(kind, KV_BYTES, KV_BYTES)
    local, remote = page_rows(side.kv.data_ptr(), [2]), page_rows(peer.base, [3])
    try:
        side.endpoint.write(peer.address, local, remote, timeout_s=30)  # connected first
        peer.proc.kill()
        peer.proc.wait(timeout=30)
        for _ in range(2):
            t0 = time.monotonic()
            with pytest.raises(HandoffTransferError):
                side.endpoint.write(peer.address, local, remote, timeout_s=5)
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


@pytest.mark.parametrize("where", ["transfer", "poll"])
def test_a_nixl_error_in_a_transfer_fails_the_write_and_releases_its_handle(where):
    """Whatever NIXL raises once a transfer exists, the write fails as a HandoffTransferError
    (never NIXL's own exception), its handle is released, and the endpoint goes on."""
    pytest.importorskip("nixl._api")
    side, peer = Side("nixl"), ProcessPeer("nixl", KV_BYTES, KV_BYTES)
    ep = side.endpoint
    local, remote = page_rows(side.kv.data_ptr(), [0]), page_rows(peer.base, [0])
    try:
        ep.write(peer.address, local, remote, timeout_s=30)  # connected
        real = ep._agent
        ep._agent = failing = _FailingAgent(real, where)
        with pytest.raises(HandoffTransferError, match="injected"):
            ep.write(peer.address, local, page_rows(peer.base, [1]), timeout_s=5)
        ep._agent = real
        assert len(failing.released) == 1 and ep._stuck == []
        assert ep.counters.failures == 1
        ep.write(peer.address, local, page_rows(peer.base, [2]), timeout_s=30)
        assert np.array_equal(page_view(peer.read(), 2), page_view(side.kv_bytes, 0))
    finally:
        peer.shutdown()
        side.endpoint.close()


def test_a_closed_simulated_peer_is_refused():
    side, peer = Side("simulated"), InProcessPeer("simulated", KV_BYTES, KV_BYTES)
    peer.close_endpoint()
    with pytest.raises(HandoffTransferError, match="closed"):
        side.endpoint.write(peer.address, page_rows(side.kv.data_ptr(), [0]),
                            page_rows(peer.base, [0]), timeout_s=5)
    side.endpoint.close()


# ---- lifetime, listeners, setup --------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_two_endpoints_in_one_process_listen_where_documented_and_close_cleanly(kind):
    """NIXL: one listener per endpoint, on 127.0.0.1. Mooncake 0.3.13: two per endpoint whose
    address no option chooses, 0.0.0.0 (P2P handshake) and `::` (TCP data), peers told to dial
    127.0.0.1 (if this fails, update backends/handoff_mooncake.py). Simulated: none.
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
        assert handoff_address.decode(peer.address).blob.startswith(b"127.0.0.1:")
    with side.endpoint as ep:
        ep.write(peer.address, page_rows(side.kv.data_ptr(), [6]), page_rows(peer.base, [7]),
                 timeout_s=30)
        assert np.array_equal(page_view(peer.read(), 7), page_view(side.kv_bytes, 6))
    peer.shutdown()
    ep.close()  # again: nothing happens
    assert set(listening([me])) - before == set()
    with pytest.raises(ClosedError):
        ep.write(peer.address, page_rows(side.kv.data_ptr(), [6]), page_rows(peer.base, [7]), 5)
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
        regions = handoff_address.decode(ep.address()).regions
        assert [(r.addr, r.nbytes, r.device) for r in regions] == \
            [(pool.data_ptr(), pool.nbytes, "cpu")]
        with pytest.raises(CacheUsageError, match="overlap"):
            ep.register(pool.data_ptr() + 4096, 4096)
        with pytest.raises(ConfigError):
            ep.register(pool.data_ptr(), pool.nbytes, device="gpu0")


def test_open_endpoint_checks_the_kind_and_the_simulated_one_refuses_gpu_memory():
    with pytest.raises(ConfigError, match="nixl, mooncake, simulated"):
        open_endpoint("rdma", "x")
    pool = torch.zeros(4096, dtype=torch.uint8)
    with open_endpoint(HandoffTransportKind.SIMULATED, "x") as ep:
        with pytest.raises(ConfigError, match="host memory only"):
            ep.register(pool.data_ptr(), pool.nbytes, device="cuda:0")
        assert handoff_address.decode(ep.address()).regions == ()


@pytest.mark.parametrize("kind, module, package, other", [
    ("nixl", "nixl._api", "pip install nixl", "mooncake"),
    ("mooncake", "mooncake.engine", "mooncake-transfer-engine-non-cuda", "nixl")])
def test_a_missing_library_names_its_package_and_the_other_transport(monkeypatch, kind, module,
                                                                     package, other):
    monkeypatch.setitem(sys.modules, module, None)  # `import` of it now raises ImportError
    with pytest.raises(HandoffUnavailable) as info:
        open_endpoint(kind, "missing")
    assert package in str(info.value) and f"{other} handoff transport" in str(info.value)
