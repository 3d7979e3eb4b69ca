"""The cache controller: merged, in-order write acks; layer-by-layer loads; errors; shutdown."""
from __future__ import annotations

import threading

import pytest
import torch

from kvtier.errors import ClosedError, TransferError
from kvtier.kv_spec import KVSpec
from kvtier.policies import IoBackend, MemLayout
from kvtier.tiers import controller as controller_module
from kvtier.tiers import page_copy
from kvtier.tiers.controller import CacheController, TransferStats
from kvtier.tiers.device_pool import DevicePool
from kvtier.tiers.host_pool import HostPool

SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=4, page_size=2, dtype=torch.float32)
DEV_PAGES, HOST_PAGES = 8, 16
TIMEOUT_S = 10


@pytest.fixture(params=[MemLayout.PAGE_FIRST, MemLayout.PAGE_FIRST_DIRECT, MemLayout.LAYER_FIRST])
def pools(request):
    dev = DevicePool(SPEC, DEV_PAGES, device="cpu")
    dev.kv.copy_(torch.randn(dev.kv.shape, generator=torch.Generator().manual_seed(1)))
    with dev, HostPool(SPEC, HOST_PAGES, request.param) as host:
        yield dev, host


class Gate:
    """Wraps copy_pages: records every call and can hold the worker inside a chosen call."""

    def __init__(self, monkeypatch, hold_call: int | None = 0, fail_call: int | None = None) -> None:
        self.calls: list[tuple[int, slice]] = []  # (pages, layers)
        self.entered, self.release = threading.Event(), threading.Event()
        self.hold_call, self.fail_call = hold_call, fail_call
        real = page_copy.copy_pages

        def copy(src, dst, plan, backend, layers=slice(None), non_blocking=False):
            index = len(self.calls)
            self.calls.append((plan.num_pages, layers))
            if index == self.hold_call:
                self.entered.set()
                assert self.release.wait(TIMEOUT_S)
            if index == self.fail_call:
                raise RuntimeError("injected copy failure")
            real(src, dst, plan, backend, layers, non_blocking)

        monkeypatch.setattr(controller_module, "copy_pages", copy)

    def hold(self) -> None:
        assert self.entered.wait(TIMEOUT_S)


def test_writes_land_and_are_acked_in_order(pools):
    dev, host = pools
    with CacheController(dev, host) as ctl:
        ids = [ctl.write([d], [h]) for d, h in ((5, 3), (1, 9), (2, 0))]
        ctl.wait_writes()
        assert ctl.poll_writes() == ids
        assert ctl.poll_writes() == []
        back = DevicePool(SPEC, DEV_PAGES, device="cpu")
        with CacheController(back, host) as loader:
            loader.load([3, 9, 0], [0, 1, 2]).wait()
        for d, b in ((5, 0), (1, 1), (2, 2)):
            assert torch.equal(back.kv[:, :, b], dev.kv[:, :, d])


def test_waiting_writes_merge_into_one_batch_and_ack_in_order(pools, monkeypatch):
    dev, host = pools
    gate = Gate(monkeypatch)
    with CacheController(dev, host) as ctl:
        first = ctl.write([0], [0])
        gate.hold()  # the worker sits inside the first copy; the next writes queue up
        rest = [ctl.write([d], [h]) for d, h in ((3, 7), (4, 2), (5, 11))]
        assert ctl.poll_writes() == []
        gate.release.set()
        ctl.wait_writes()
        assert ctl.poll_writes() == [first, *rest]
        assert [pages for pages, _ in gate.calls] == [1, 3]
        stats = ctl.stats()
        assert (stats.write_ops, stats.write_batches) == (4, 2)
        assert stats.write_bytes == 4 * SPEC.page_bytes and stats.write_s >= 0
    assert torch.equal(host.layer_page_view()[:, :, 11], dev.kv[:, :, 5])


def test_writes_to_the_same_host_page_stay_ordered(pools, monkeypatch):
    dev, host = pools
    gate = Gate(monkeypatch)
    with CacheController(dev, host) as ctl:
        ctl.write([0], [0])
        gate.hold()
        ctl.write([1], [4])
        ctl.write([2], [4])  # overlaps the previous write: not merged, so the later one wins
        gate.release.set()
        ctl.wait_writes()
        assert [pages for pages, _ in gate.calls] == [1, 1, 1]
    assert torch.equal(host.layer_page_view()[:, :, 4], dev.kv[:, :, 2])


def test_loads_go_before_waiting_writes(pools, monkeypatch):
    dev, host = pools
    gate = Gate(monkeypatch)
    with CacheController(dev, host) as ctl:
        ctl.write([0, 1], [0, 1])
        gate.hold()
        ctl.write([2, 3, 4], [2, 3, 4])
        handle = ctl.load([0], [7])
        gate.release.set()
        handle.wait()
        ctl.wait_writes()
        assert [pages for pages, _ in gate.calls] == [2, 1, 3]
    assert torch.equal(dev.kv[:, :, 7], dev.kv[:, :, 0])


def test_load_goes_layer_by_layer(pools, monkeypatch):
    dev, host = pools
    monkeypatch.setattr(page_copy, "MIN_CALL_BYTES", 1)  # one layer per call even for tiny pages
    with CacheController(dev, host) as ctl:
        ctl.write([2, 3], [5, 6])
        ctl.wait_writes()
    target = DevicePool(SPEC, DEV_PAGES, device="cpu")
    gate = Gate(monkeypatch, hold_call=1)  # hold the worker inside layer 1
    with CacheController(target, host) as ctl:
        handle = ctl.load([5, 6], [0, 1])
        gate.hold()
        handle.wait_layer(0)
        ctl.wait_layer(0)
        assert torch.equal(target.kv[:, 0, :2], dev.kv[:, 0, 2:4])
        assert not target.kv[:, 1:].any()  # layer 1 and later have not landed yet
        gate.release.set()
        ctl.wait_layer(SPEC.num_layers - 1)
        assert handle.done()
        assert [layers for _, layers in gate.calls] == [slice(l, l + 1) for l in range(SPEC.num_layers)]
        assert ctl.stats().load_bytes == 2 * SPEC.page_bytes
    assert torch.equal(target.kv[:, :, :2], dev.kv[:, :, 2:4])


def test_controller_wait_layer_covers_every_load(pools):
    dev, host = pools
    with CacheController(dev, host, IoBackend.DIRECT) as ctl:
        ctl.write([0, 1, 2], [8, 9, 10])
        ctl.wait_writes()
        handles = [ctl.load([8], [5]), ctl.load([9, 10], [6, 7])]
        for layer in range(SPEC.num_layers):
            ctl.wait_layer(layer)
        assert all(h.done() for h in handles)
        assert ctl.stats().load_ops == 2
    assert torch.equal(dev.kv[:, :, 5:8], dev.kv[:, :, 0:3])


def test_write_failure_surfaces_after_earlier_acks(pools, monkeypatch):
    dev, host = pools
    gate = Gate(monkeypatch, hold_call=None, fail_call=1)
    with CacheController(dev, host) as ctl:
        ok = ctl.write([0], [0])
        ctl.wait_writes()
        bad = ctl.write([1], [1])
        with pytest.raises(TransferError, match="free them") as info:
            ctl.wait_writes()
        assert info.value.op_ids == (bad,)
        later = ctl.write([2], [2])
        ctl.wait_writes()
        assert ctl.poll_writes() == [ok]  # acks before the failure come first
        assert ctl.poll_writes() == [later]  # the failure was reported once, by wait_writes


def test_poll_raises_a_write_failure_once(pools, monkeypatch):
    dev, host = pools
    Gate(monkeypatch, hold_call=None, fail_call=0)
    with CacheController(dev, host) as ctl:
        bad = ctl.write([1], [1])
        while not ctl._unacked[0].fence.settled():
            threading.Event().wait(0.01)
        with pytest.raises(TransferError) as info:
            ctl.poll_writes()
        assert info.value.op_ids == (bad,) and isinstance(info.value.__cause__, RuntimeError)
        assert ctl.poll_writes() == []


def test_closed_pool_fails_the_write_not_the_worker(pools):
    dev, host = pools
    other = HostPool(SPEC, HOST_PAGES, host.layout)
    with CacheController(dev, other) as ctl:
        other.close()
        ctl.write([0], [0])
        with pytest.raises(TransferError, match="closed"):
            ctl.wait_writes()
        assert ctl._thread.is_alive()


def test_load_failure_surfaces_on_every_wait(pools, monkeypatch):
    dev, host = pools
    Gate(monkeypatch, hold_call=None, fail_call=0)
    with CacheController(dev, host) as ctl:
        handle = ctl.load([0, 1], [2, 3])
        fine = ctl.load([4], [5])
        assert ctl.wait_layer(0) == (handle,)  # the failed load, named, not raised
        with pytest.raises(TransferError, match="recompute"):
            handle.wait()
        assert ctl.wait_layer(0) == ()  # reported once at controller level
        assert not handle.done()
        fine.wait()


def test_bad_page_lists_raise_at_submit(pools):
    dev, host = pools
    with CacheController(dev, host) as ctl:
        with pytest.raises(TransferError):
            ctl.write([0, 1], [0])
        with pytest.raises(TransferError):
            ctl.load([HOST_PAGES], [0])
        with pytest.raises(TransferError):
            ctl.load([0], [0]).wait_layer(SPEC.num_layers)


def test_close_joins_the_worker_and_refuses_further_use(pools):
    dev, host = pools
    ctl = CacheController(dev, host)
    ctl.write([0], [0])
    ctl.close()
    assert not ctl._thread.is_alive()
    assert ctl.stats().write_ops == 1  # queued work finished before the worker stopped
    ctl.close()  # idempotent
    for call in (lambda: ctl.write([1], [1]), lambda: ctl.load([0], [1]), ctl.poll_writes,
                 ctl.wait_writes, lambda: ctl.wait_layer(0)):
        with pytest.raises(ClosedError):
            call()


def test_stats_snapshot_is_frozen():
    stats = TransferStats()
    with pytest.raises(AttributeError):
        stats.write_bytes = 1  # type: ignore[misc]
    assert stats.load_s == 0.0


def test_mismatched_specs_are_refused():
    dev = DevicePool(SPEC, DEV_PAGES, device="cpu")
    other = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, page_size=2)
    with HostPool(other, 4) as host, pytest.raises(TransferError, match="one spec"):
        CacheController(dev, host)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", list(MemLayout))
def test_cuda_round_trip_through_streams(layout):
    dev = DevicePool(SPEC, DEV_PAGES)
    assert dev.device.type == "cuda"
    dev.kv.copy_(torch.randn(dev.kv.shape, device=dev.device))
    with dev, HostPool(SPEC, HOST_PAGES, layout) as host, CacheController(dev, host) as ctl:
        assert host.pinned
        ids = [ctl.write([5, 1], [9, 3]), ctl.write([2], [4])]
        ctl.wait_writes()
        assert ctl.poll_writes() == ids
        expected = dev.kv[:, :, [5, 1, 2]].clone()
        dev.kv.zero_()  # on the compute stream: the load must wait for it
        ctl.load([9, 3, 4], [0, 6, 7])
        for layer in range(SPEC.num_layers):
            ctl.wait_layer(layer)
        assert torch.equal(dev.kv[:, :, [0, 6, 7]], expected)
        assert ctl.stats().load_bytes == 3 * SPEC.page_bytes
