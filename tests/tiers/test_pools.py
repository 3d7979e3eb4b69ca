"""L1/L2 pools, their layouts and the page copies between them (tiny shapes, CPU)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.errors import AllocatorError, ClosedError, ConfigError, HostMemoryError, TransferError
from kvtier.kv_spec import KVSpec
from kvtier.policies import IoBackend, MemLayout
from kvtier.tiers import host_pool as host_pool_module
from kvtier.tiers.device_pool import DevicePool
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers import page_copy
from kvtier.tiers.page_copy import CopyPlan, Gather, PageRun, copy_pages

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, page_size=2, dtype=torch.bfloat16)
DEV_PAGES, HOST_PAGES = 8, 12
LAYOUTS = list(MemLayout)
PAGE_LAYOUTS = [m for m in MemLayout if m.is_page_major]


def filled_device(spec: KVSpec = SPEC, pages: int = DEV_PAGES, seed: int = 0) -> DevicePool:
    pool = DevicePool(spec, pages, device="cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def write(dev: DevicePool, host: HostPool, dev_pages, host_pages, backend=IoBackend.KERNEL) -> None:
    plan = CopyPlan.build(dev_pages, host_pages, dev.num_pages, host.num_pages)
    copy_pages(dev.layer_page_view(), host.layer_page_view(), plan, backend)


def load(host: HostPool, dev: DevicePool, host_pages, dev_pages, backend=IoBackend.KERNEL, layers=slice(None)):
    plan = CopyPlan.build(host_pages, dev_pages, host.num_pages, dev.num_pages)
    copy_pages(host.layer_page_view(), dev.layer_page_view(), plan, backend, layers)


def page_pairs(max_pages: int = DEV_PAGES):
    """Random, non-contiguous (src, L2, dst) page lists of one length."""
    n = st.integers(1, max_pages)
    return n.flatmap(lambda k: st.tuples(
        st.permutations(range(DEV_PAGES)).map(lambda p: p[:k]),
        st.permutations(range(HOST_PAGES)).map(lambda p: p[:k]),
        st.permutations(range(DEV_PAGES)).map(lambda p: p[:k]),
    ))


@settings(max_examples=25, deadline=None)
@given(pairs=page_pairs(), layout=st.sampled_from(LAYOUTS), backend=st.sampled_from(list(IoBackend)))
def test_round_trip_is_exact(pairs, layout, backend):
    src_pages, host_pages, dst_pages = pairs
    src = filled_device()
    with HostPool(SPEC, HOST_PAGES, layout) as host, DevicePool(SPEC, DEV_PAGES, device="cpu") as dst:
        write(src, host, src_pages, host_pages, backend)
        load(host, dst, host_pages, dst_pages, backend)
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(dst.kv[:, :, d], src.kv[:, :, s])
        untouched = sorted(set(range(DEV_PAGES)) - set(dst_pages))
        assert not dst.kv[:, :, untouched].any()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_bytes_follow_the_layout(layout):
    dev = filled_device()
    with HostPool(SPEC, HOST_PAGES, layout) as host:
        write(dev, host, [3, 1], [5, 9])
        P = SPEC.page_size
        for d, h in ((3, 5), (1, 9)):
            for part in (0, 1):
                expected = dev.kv[part, :, d]  # (L, P, H, D)
                if layout is MemLayout.LAYER_FIRST:
                    got = host.kv[part, :, h * P : (h + 1) * P]
                elif layout is MemLayout.PAGE_FIRST:
                    got = host.kv[part, h * P : (h + 1) * P].transpose(0, 1)
                elif layout is MemLayout.PAGE_HEAD:  # (H, L, P, D): head-major
                    got = host.kv[part, h].permute(1, 2, 0, 3)
                else:
                    got = host.kv[part, h]
                assert torch.equal(got, expected)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("backend", list(IoBackend))
def test_per_layer_load_lands_only_that_layer(layout, backend):
    src = filled_device()
    with HostPool(SPEC, HOST_PAGES, layout) as host, DevicePool(SPEC, DEV_PAGES, device="cpu") as dst:
        write(src, host, [0, 1, 5], [7, 2, 3])
        load(host, dst, [7, 2, 3], [4, 6, 1], backend, layers=slice(1, 2))
        for s, d in ((0, 4), (1, 6), (5, 1)):
            assert torch.equal(dst.kv[:, 1, d], src.kv[:, 1, s])
        assert not dst.kv[:, 0].any() and not dst.kv[:, 2].any()


@pytest.mark.parametrize("layout", PAGE_LAYOUTS)
def test_page_part_view_is_the_page_in_place(layout):
    dev = filled_device()
    with HostPool(SPEC, HOST_PAGES, layout) as host:
        write(dev, host, [2], [4])
        for part in (0, 1):
            view = host.page_part_view(4, part)
            assert view.dtype == torch.uint8 and view.dim() == 1 and view.numel() == SPEC.page_part_bytes
            assert view.untyped_storage().data_ptr() == host.kv.untyped_storage().data_ptr()
            order = {MemLayout.PAGE_FIRST_DIRECT: dev.kv[part, :, 2],
                     MemLayout.PAGE_FIRST: dev.kv[part, :, 2].transpose(0, 1),
                     MemLayout.PAGE_HEAD: dev.kv[part, :, 2].permute(2, 0, 1, 3)}[layout]
            assert torch.equal(view, order.contiguous().view(-1).view(torch.uint8))
        host.page_part_view(4, 1).zero_()  # zero copy: writing the view writes the pool
        back = DevicePool(SPEC, DEV_PAGES, device="cpu")
        back.kv.fill_(1)
        load(host, back, [4], [0])
        assert not back.kv[1, :, 0].any() and torch.equal(back.kv[0, :, 0], dev.kv[0, :, 2])


def test_page_head_view_is_one_heads_bytes_in_place():
    dev = filled_device()
    with HostPool(SPEC, HOST_PAGES, MemLayout.PAGE_HEAD) as host:
        write(dev, host, [2], [4])
        for head in range(SPEC.num_kv_heads):
            for part in (0, 1):
                view = host.page_head_view(4, head, part)
                assert view.numel() == SPEC.page_part_bytes // SPEC.num_kv_heads
                want = dev.kv[part, :, 2, :, head]  # (L, P, D) of that head
                assert torch.equal(view, want.contiguous().view(-1).view(torch.uint8))
        host.page_head_view(4, 1, 0).zero_()  # zero copy: only that head of K changes
        assert not host.layer_page_view()[0, :, 4, :, 1].any()
        assert torch.equal(host.layer_page_view()[0, :, 4, :, 0], dev.kv[0, :, 2, :, 0])
        with pytest.raises(TransferError):
            host.page_head_view(4, SPEC.num_kv_heads, 0)
    for layout in (MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST, MemLayout.PAGE_FIRST_DIRECT):
        with HostPool(SPEC, HOST_PAGES, layout) as host, \
                pytest.raises(ConfigError, match="page_head"):
            host.page_head_view(0, 0, 0)


def test_page_part_view_rejects_layer_first_and_bad_arguments():
    with HostPool(SPEC, HOST_PAGES, MemLayout.LAYER_FIRST) as host:
        with pytest.raises(ConfigError, match="page_first"):
            host.page_part_view(0, 0)
    with HostPool(SPEC, HOST_PAGES, MemLayout.PAGE_FIRST) as host:
        with pytest.raises(AllocatorError):
            host.page_part_view(HOST_PAGES, 0)
        with pytest.raises(TransferError):
            host.page_part_view(0, 2)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_host_pool_shape_and_registration_facts(layout):
    with HostPool(SPEC, HOST_PAGES, layout) as host:
        assert host.nbytes == host.kv.numel() * host.kv.element_size() == HOST_PAGES * SPEC.page_bytes
        assert host.data_ptr() == host.kv.data_ptr()
        assert host.data_ptr() % 4096 == 0  # O_DIRECT-ready
        assert host.pinned is torch.cuda.is_available()
        assert host.layer_page_view().shape == (2, 3, HOST_PAGES, 2, 2, 4)
    with pytest.raises(ClosedError):
        host.kv


def _resident_bytes(addr: int) -> int | None:
    """Rss of the mapping that holds `addr` (from /proc/self/smaps), None where unreadable."""
    try:
        with open("/proc/self/smaps", encoding="ascii") as fh:
            inside = False
            for line in fh:
                head = line.split()[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= addr < hi
                elif inside and head == "Rss:":
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@pytest.mark.skipif(torch.cuda.is_available(), reason="pinned memory is resident by itself")
@pytest.mark.skipif(not host_pool_module.MAP_POPULATE, reason="no MAP_POPULATE on this platform")
def test_host_pool_is_resident_from_the_start():
    """The CPU L2 mapping is faulted in when made: an L2 page's first copy (a write_back
    eviction on the request path) must not pay the page faults."""
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=64, page_size=64, dtype=torch.float32)
    with HostPool(spec, 16) as host:  # 4 MiB, never written
        rss = _resident_bytes(host.data_ptr())
        if rss is None:
            pytest.skip("/proc/self/smaps is not readable here")
        assert rss >= host.nbytes


def test_host_pool_accepts_the_layout_spelling():
    with HostPool(SPEC, 2, "page-first-direct") as host:
        assert host.layout is MemLayout.PAGE_FIRST_DIRECT


def test_host_sizing_by_ratio_and_by_gb():
    dev = DevicePool(SPEC, DEV_PAGES, device="cpu")
    with HostPool.for_device(dev, MemLayout.PAGE_FIRST) as host:
        assert host.num_pages == 2 * DEV_PAGES
    with HostPool.for_device(dev, ratio=3.5) as host:
        assert host.num_pages == int(3.5 * DEV_PAGES)
    with HostPool.for_device(dev, ratio=2.0, size_gb=1e-5) as host:  # size wins over ratio
        assert host.num_pages == 10_000 // SPEC.page_bytes
    for kwargs in ({"ratio": 0}, {"size_gb": -1.0}, {"size_gb": 1e-9}):
        with pytest.raises(ConfigError):
            HostPool.for_device(dev, **kwargs)


def test_host_memory_error_says_what_to_lower(monkeypatch):
    monkeypatch.setattr(host_pool_module, "available_host_bytes", lambda: 2 * 2**30)
    dev = DevicePool(SPEC, DEV_PAGES, device="cpu")
    with pytest.raises(HostMemoryError, match=r"asked 1\.40 GiB .* only 1\.00 GiB .*--hicache-ratio/--hicache-size"):
        HostPool.for_device(dev, size_gb=1.5)
    with HostPool.for_device(dev, size_gb=0.0001) as host:  # small requests still pass
        assert host.num_pages >= 1
    monkeypatch.setattr(host_pool_module, "available_host_bytes", lambda: None)
    with HostPool(SPEC, 2) as host:  # unknown available memory: allocate unchecked
        assert host.num_pages == 2


def test_available_host_bytes_reads_meminfo():
    available = host_pool_module.available_host_bytes()
    assert available is None or available > 0


def test_device_pool_layer_views_and_close():
    with DevicePool(SPEC, DEV_PAGES, device="cpu") as dev:
        assert dev.kv.shape == (2, 3, DEV_PAGES, 2, 2, 4) and dev.nbytes == DEV_PAGES * SPEC.page_bytes
        k, v = dev.layer(2)
        assert k.shape == v.shape == (DEV_PAGES, 2, 2, 4)
        k[5].fill_(3)
        assert (dev.kv[0, 2, 5] == 3).all() and not dev.kv[1].any()
    with pytest.raises(ClosedError):
        dev.layer(0)
    with pytest.raises(ConfigError):
        DevicePool(SPEC, 0)


def test_allocator_pages_round_trip_and_recycle():
    src = filled_device()
    with HostPool(SPEC, HOST_PAGES, MemLayout.PAGE_FIRST_DIRECT) as host:
        dev_pages = src.allocator.alloc(5)
        host_pages = host.allocator.alloc(5)
        assert dev_pages == host_pages == [0, 1, 2, 3, 4]  # fresh ids ascend: copies merge
        assert len(CopyPlan.build(dev_pages, host_pages, DEV_PAGES, HOST_PAGES).runs) == 1
        write(src, host, dev_pages, host_pages)
        expected = src.kv[:, :, 1:4].clone()
        src.allocator.free(dev_pages[1:4])
        src.kv[:, :, 1:4].zero_()  # the pages were evicted from L1 and reused
        again = src.allocator.alloc(3)
        assert sorted(again) == [1, 2, 3]
        load(host, src, host_pages[1:4], again)
        assert torch.equal(src.kv[:, :, 1:4], expected)
        assert host.allocator.alloc(HOST_PAGES) is None


def test_plan_merges_runs_sorted_by_destination():
    plan = CopyPlan.build([9, 5, 6, 7, 1], [4, 0, 1, 2, 3], 10, 10)
    assert plan.dst_pages == (0, 1, 2, 3, 4) and plan.src_pages == (5, 6, 7, 1, 9)
    assert plan.runs == (PageRun(5, 0, 3), PageRun(1, 3, 1), PageRun(9, 4, 1))
    (gather,) = plan.gathers
    assert (gather.dst, gather.n) == (0, 5) and gather.src.tolist() == [5, 6, 7, 1, 9]
    assert CopyPlan.build([3, 4], [7, 8], 10, 10).gathers == (Gather(7, 2, 3, None),)
    assert plan.calls(IoBackend.KERNEL) == 1 and plan.calls(IoBackend.DIRECT) == 3


def test_plan_rejects_bad_page_lists():
    with pytest.raises(TransferError, match="length"):
        CopyPlan.build([1, 2], [1], 4, 4)
    with pytest.raises(TransferError, match="twice"):
        CopyPlan.build([1, 2], [3, 3], 4, 4)
    with pytest.raises(TransferError, match="outside"):
        CopyPlan.build([4], [0], 4, 4)
    assert CopyPlan.build([], [], 4, 4).num_pages == 0


def test_layer_groups_grow_only_when_calls_are_small():
    big = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, page_size=64)
    contiguous = CopyPlan.build(range(256), range(256), 512, 512)
    assert contiguous.layers_per_call(IoBackend.DIRECT, big.page_layer_bytes, 30) == 1
    runs_of_8 = CopyPlan.build(range(256), [16 * (i // 8) + i % 8 for i in range(256)], 512, 512)
    assert runs_of_8.calls(IoBackend.DIRECT) == 32
    group = runs_of_8.layers_per_call(IoBackend.DIRECT, big.page_layer_bytes, 30)
    assert 1 < group < 30
    assert group * 2 * 8 * big.page_layer_bytes >= page_copy.MIN_CALL_BYTES
    scattered = CopyPlan.build(range(0, 512, 2), range(1, 512, 2), 512, 512)
    assert scattered.layers_per_call(IoBackend.DIRECT, big.page_layer_bytes, 30) == 30
    assert CopyPlan.build([], [], 4, 4).layers_per_call(IoBackend.KERNEL, 10, 3) == 3
