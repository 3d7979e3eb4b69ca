"""The sliding-window sidecar: slots follow pages through frees, copies and eviction."""
from __future__ import annotations

import pytest
import torch

from kvtier.errors import AllocatorError, ConfigError
from kvtier.kv_spec import KVSpec, SlidingSpec
from kvtier.policies import MemLayout
from kvtier.tiers.device_pool import DevicePool
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.sidecar import copy_sidecar, sidecar_slots

SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32,
              sliding=SlidingSpec(num_layers=3, window=9))


def _fill(pool, page: int, value: float) -> None:
    side = pool.sidecar
    side.slots.layer_page_view()[:, :, side.slot(page)] = value


def _read(pool, page: int) -> torch.Tensor:
    side = pool.sidecar
    return side.slots.layer_page_view()[:, :, side.slot(page)]


@pytest.mark.parametrize("window,page,pages", [(9, 4, 2), (8, 4, 2), (5, 4, 1), (512, 64, 8),
                                               (513, 64, 8), (514, 64, 9), (2, 1, 1)])
def test_window_pages_cover_what_the_first_resumed_query_sees(window, page, pages):
    spec = SlidingSpec(num_layers=1, window=window)
    assert spec.window_pages(page) == pages
    n = 20  # a hit of n pages resumes at position n*page: its keys reach back window-1
    first_key = n * page - (window - 1)
    assert (n - pages) * page <= max(first_key, 0) < (n - pages + 1) * page


def test_plain_spec_has_no_sidecar():
    plain = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4)
    assert plain.sidecar is None and plain.window_pages == 0
    assert DevicePool(plain, 4).sidecar is None
    assert SPEC.sidecar.num_layers == 3 and SPEC.sidecar.sliding is None


def test_a_freed_page_drops_its_slot():
    pool = DevicePool(SPEC, 16, "cpu", slots=6)
    pages = pool.allocator.alloc(4)
    assert pool.sidecar.assign(pages)
    assert pool.sidecar.present(pages) == [True] * 4 and pool.sidecar.used_slots == 4
    pool.sidecar.unlock(pages)
    pool.allocator.free(pages[:2])
    assert pool.sidecar.present(pages) == [False, False, True, True]
    assert pool.sidecar.used_slots == 2
    pool.allocator.free(pages[2:])
    assert pool.sidecar.audit() == (0, 0) and pool.sidecar.used_slots == 0


def test_assign_evicts_cached_slots_oldest_first_and_never_locked_ones():
    pool = DevicePool(SPEC, 16, "cpu", slots=4)
    a = pool.allocator.alloc(4)
    assert pool.sidecar.assign(a)  # locked
    b = pool.allocator.alloc(2)
    assert not pool.sidecar.assign(b)  # every slot is locked: nothing changes
    assert pool.sidecar.present(b) == [False, False]
    pool.sidecar.unlock(a[1:])  # a[1], a[2], a[3] cached in that order
    pool.sidecar.touch([a[1]])  # a[1] is now the most recently used
    assert pool.sidecar.assign(b)
    assert pool.sidecar.present(a) == [True, True, False, False]
    assert pool.sidecar.evicted_slots == 2


def test_release_keeps_locked_slots():
    pool = DevicePool(SPEC, 8, "cpu", slots=4)
    pages = pool.allocator.alloc(3)
    pool.sidecar.assign(pages)
    pool.sidecar.unlock(pages[:2])
    assert pool.sidecar.release(pages) == 2
    assert pool.sidecar.present(pages) == [False, False, True]


def test_unbalanced_unlock_raises():
    pool = DevicePool(SPEC, 8, "cpu", slots=4)
    pages = pool.allocator.alloc(1)
    pool.sidecar.assign(pages, locked=False)
    with pytest.raises(AllocatorError, match="unbalanced"):
        pool.sidecar.unlock(pages)


@pytest.mark.parametrize("layout", list(MemLayout))
def test_copies_move_sliding_kv_byte_exact_both_ways(layout):
    device = DevicePool(SPEC, 8, "cpu", slots=8)
    host = HostPool(SPEC, 8, layout, slots=8)
    pages = device.allocator.alloc(3)
    device.sidecar.assign(pages[1:])  # the first page has no sliding KV (a tombstone)
    for i, p in enumerate(pages[1:]):
        _fill(device, p, float(i + 1))
    host_pages = host.allocator.alloc(3)
    assert copy_sidecar(device.sidecar, host.sidecar, pages, host_pages) == 2
    assert host.sidecar.present(host_pages) == [False, True, True]
    back = device.allocator.alloc(3)
    assert copy_sidecar(host.sidecar, device.sidecar, host_pages, back) == 2
    assert device.sidecar.present(back) == [False, True, True]
    for src, dst in zip(pages[1:], back[1:]):
        assert torch.equal(_read(device, src), _read(device, dst))


def test_a_full_destination_keeps_the_trailing_pages():
    device = DevicePool(SPEC, 8, "cpu", slots=8)
    host = HostPool(SPEC, 8, MemLayout.PAGE_FIRST, slots=2)
    pages = device.allocator.alloc(4)
    device.sidecar.assign(pages)
    host_pages = host.allocator.alloc(4)
    assert copy_sidecar(device.sidecar, host.sidecar, pages, host_pages) == 2
    assert host.sidecar.present(host_pages) == [False, False, True, True]


def test_slot_count_is_validated_and_defaults_to_a_few_windows():
    with pytest.raises(ConfigError, match="positive slot count"):
        sidecar_slots(SPEC, 16, 0)
    assert sidecar_slots(SPEC, 1000, None) == 250  # L2: a quarter
    assert sidecar_slots(SPEC, 1000, None, 1.0) == 1000  # L1: one per page
    assert DevicePool(SPEC, 40, "cpu").sidecar.slots.num_pages == 40
    assert sidecar_slots(SPEC, 16, None) == 12  # four windows of 2 pages, plus one page each
    assert sidecar_slots(SPEC, 5, None) == 5


def test_relayout_for_l3_moves_the_sidecar_with_its_pool():
    host = HostPool(SPEC, 8, MemLayout.PAGE_FIRST, slots=4)
    pages = host.allocator.alloc(2)
    assert host.sidecar.assign(pages, locked=False)
    for p, value in zip(pages, (3.0, 4.0)):
        _fill(host, p, value)
    before = [_read(host, p).clone() for p in pages]
    host.relayout(MemLayout.PAGE_HEAD)
    assert host.sidecar.slots.layout is MemLayout.PAGE_HEAD
    assert all(torch.equal(_read(host, p), b) for p, b in zip(pages, before))
    host.sidecar.slots.page_head_view(host.sidecar.slot(pages[0]), 0, 0)  # objects in place
