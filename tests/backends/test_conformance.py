"""The conformance suite every L3 backend passes, against the real library."""
from __future__ import annotations

import threading

import pytest
import torch

from kvtier.backends.base import KV_POOL, PagePart, StorageUnavailable
from kvtier.errors import CacheUsageError
from kvtier.keys import page_hashes
from kvtier.policies import HitPolicy, MemLayout
from tests.backends.conftest import SPEC



def keys(n, salt=0):
    return page_hashes(list(range(salt, salt + 4 * n)), 4)


def page_bytes(pool, page):
    return [pool.page_part_view(page, part).clone() for part in (0, 1)]


def head_bytes(pool, page, head):
    return [pool.page_head_view(page, head, part).clone() for part in (0, 1)]


def same_page(pool_a, page_a, pool_b, page_b):
    return all(torch.equal(x, y) for x, y in zip(page_bytes(pool_a, page_a), page_bytes(pool_b, page_b)))


def test_round_trip_is_byte_exact(harness):
    src, dst = harness.pool(), harness.pool()
    b = harness.backend()
    b.register_pool(KV_POOL, src)
    ks = keys(5)
    assert b.set_from(KV_POOL, ks, [3, 1, 4, 0, 9]).ok == [True] * 5
    reader = harness.backend()
    reader.register_pool(KV_POOL, dst)
    res = reader.get_into(KV_POOL, ks, [10, 11, 12, 13, 14])
    assert res.ok == [True] * 5 and res.leading_ok == 5
    for s, d in zip([3, 1, 4, 0, 9], [10, 11, 12, 13, 14]):
        assert same_page(src, s, dst, d)
    # the per-object figures: each page is one object per KV head and part
    objects = 5 * SPEC.num_kv_heads * 2
    w, r = b.stats(), reader.stats()
    assert (w.objects_written, r.objects_read) == (objects, objects)
    assert r.bytes_read // r.objects_read == SPEC.page_bytes // (SPEC.num_kv_heads * 2)


@pytest.mark.parametrize("layout", [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST,
                                    MemLayout.PAGE_FIRST_DIRECT])
def test_pools_without_head_runs_are_refused_with_advice(harness, layout):
    b = harness.backend()
    with pytest.raises(CacheUsageError, match="page_head"):
        b.register_pool(KV_POOL, harness.pool(layout))


def test_one_head_per_rank_writers_fill_pages_a_whole_head_reader_reads(harness):
    """Cross TP: two TP=2 ranks each write their head; a TP=1 client reads whole pages, and
    writes pages the TP=2 ranks read back, byte for byte per head."""
    ranks = [harness.backend(rank=r, size=2) for r in range(2)]
    shards = [harness.pool(size=2) for _ in range(2)]
    whole, back = harness.pool(), [harness.pool(size=2) for _ in range(2)]
    for b, pool in zip(ranks, shards):
        b.register_pool(KV_POOL, pool)
    reader = harness.backend()
    reader.register_pool(KV_POOL, whole)
    ks = keys(3)
    assert ranks[0].set_from(KV_POOL, ks, [0, 1, 2]).ok == [True] * 3
    assert reader.exists(ks).usable_pages == 0  # head 1 is missing: a miss, never half a page
    assert ranks[1].set_from(KV_POOL, ks, [0, 1, 2]).ok == [True] * 3
    assert reader.get_into(KV_POOL, ks, [5, 6, 7]).ok == [True] * 3
    for r in range(2):
        for src, dst in zip([0, 1, 2], [5, 6, 7]):
            assert all(torch.equal(x, y) for x, y in
                       zip(head_bytes(shards[r], src, 0), head_bytes(whole, dst, r)))
    ks2 = keys(2, salt=50)
    assert reader.set_from(KV_POOL, ks2, [8, 9]).ok == [True, True]
    for r, pool in enumerate(back):
        b = harness.backend(rank=r, size=2)
        b.register_pool(KV_POOL, pool)
        assert b.get_into(KV_POOL, ks2, [3, 4]).ok == [True, True]
        for src, dst in zip([8, 9], [3, 4]):
            assert all(torch.equal(x, y) for x, y in
                       zip(head_bytes(whole, src, r), head_bytes(pool, dst, 0)))


def test_page_head_round_trip_through_l1_and_back_is_byte_exact(harness):
    """L1 -> L2 (page_head) -> L3 -> another L2 -> another L1: the same KV bytes."""
    from kvtier.policies import IoBackend
    from kvtier.tiers.controller import CacheController
    from kvtier.tiers.device_pool import DevicePool

    src_l1, dst_l1 = DevicePool(SPEC, 8, "cpu"), DevicePool(SPEC, 8, "cpu")
    gen = torch.Generator().manual_seed(7)
    src_l1.kv.copy_(torch.randn(src_l1.kv.shape, generator=gen).to(src_l1.kv.dtype))
    src_l2, dst_l2 = harness.pool(), harness.pool()
    for io in IoBackend:
        with CacheController(src_l1, src_l2, io) as c:
            c.write([1, 2, 5], [0, 1, 2])
            c.wait_writes()
        b = harness.backend()
        b.register_pool(KV_POOL, src_l2)
        ks = keys(3, salt=10 * (1 + list(IoBackend).index(io)))
        assert b.set_from(KV_POOL, ks, [0, 1, 2]).ok == [True] * 3
        reader = harness.backend()
        reader.register_pool(KV_POOL, dst_l2)
        assert reader.get_into(KV_POOL, ks, [9, 10, 11]).ok == [True] * 3
        with CacheController(dst_l1, dst_l2, io) as c:
            c.load([9, 10, 11], [0, 3, 6]).wait()
        for s, d in zip([1, 2, 5], [0, 3, 6]):
            assert torch.equal(src_l1.layer_page_view()[:, :, s], dst_l1.layer_page_view()[:, :, d])


def test_exists_counts_leading_pages_and_stops_at_gaps(harness):
    b = harness.backend()
    pool = harness.pool()
    b.register_pool(KV_POOL, pool)
    ks = keys(6)
    b.set_from(KV_POOL, [ks[i] for i in (0, 1, 3, 4)], [0, 1, 3, 4])
    assert b.exists(ks).usable_pages == 2
    assert b.exists(ks[3:5]).usable_pages == 2
    assert b.exists([]).usable_pages == 0


def test_hit_policies_and_min_over_pools(harness):
    b = harness.backend()
    kv, state = harness.pool(), harness.pool()
    b.register_pool(KV_POOL, kv)
    b.register_pool("state", state, hit_policy=HitPolicy.TRAILING_PAGES, window_pages=1)
    ks = keys(6)
    b.set_from(KV_POOL, ks[:5], [0, 1, 2, 3, 4])
    b.set_from("state", [ks[1], ks[3]], [1, 3])  # state checkpoints at pages 1 and 3 only
    res = b.exists(ks, pools=(KV_POOL, "state"))
    assert res.pool_pages == {KV_POOL: 5, "state": 4}  # trailing page 3 -> a 4-page prefix
    assert res.usable_pages == 4


def test_set_is_idempotent_and_never_overwrites(harness):
    b = harness.backend()
    pool = harness.pool()
    b.register_pool(KV_POOL, pool)
    k = keys(1)
    original = page_bytes(pool, 0)
    assert b.set_from(KV_POOL, k, [0]).ok == [True]
    pool.page_part_view(0, 0).fill_(7)  # different bytes under the same key
    assert b.set_from(KV_POOL, k, [0]).ok == [True]
    assert b.stats().write_skipped_existing >= 1
    assert b.get_into(KV_POOL, k, [5]).ok == [True]
    assert torch.equal(pool.page_part_view(5, 0), original[0])


def test_missing_part_of_one_head_hides_the_page(harness):
    r0, r1 = harness.backend(rank=0, size=2), harness.backend(rank=1, size=2)
    pool = harness.pool(size=2)
    for b in (r0, r1):
        b.register_pool(KV_POOL, pool)
    ks = keys(3)
    r0.set_from(KV_POOL, ks, [0, 1, 2])
    r1.set_from(KV_POOL, ks, [0, 1, 2])
    harness.tamper.remove(r1, r1.target.object_name(KV_POOL, ks[1], 1, PagePart.V))
    assert r0.exists(ks).usable_pages == 3
    assert r1.exists(ks).usable_pages == 1
    assert min(r0.exists(ks).usable_pages, r1.exists(ks).usable_pages) == 1
    assert r1.get_into(KV_POOL, ks, [5, 6, 7]).ok == [True, False, True]


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_objects_are_misses_never_wrong_bytes(harness, damage):
    b = harness.backend()
    pool = harness.pool()
    b.register_pool(KV_POOL, pool)
    ks = keys(3)
    b.set_from(KV_POOL, ks, [0, 1, 2])
    getattr(harness.tamper, damage)(b, b.target.object_name(KV_POOL, ks[1], 1, PagePart.K))
    res = b.get_into(KV_POOL, ks, [8, 9, 10])
    assert res.ok == [True, False, True] and res.leading_ok == 1
    assert same_page(pool, 0, pool, 8) and same_page(pool, 2, pool, 10)
    assert b.stats().corrupt_objects + b.stats().read_misses >= 1
    assert b.exists(ks).usable_pages == 1  # the bad object was dropped


def test_delete(harness):
    b = harness.backend()
    b.register_pool(KV_POOL, harness.pool())
    ks = keys(3)
    b.set_from(KV_POOL, ks, [0, 1, 2])
    assert b.delete(ks[1:2]) == 1
    assert b.exists(ks).usable_pages == 1
    assert b.delete(ks[1:2]) == 0


def test_reopen_after_close_finds_pages(harness):
    b = harness.backend()
    pool = harness.pool()
    b.register_pool(KV_POOL, pool)
    ks = keys(2)
    b.set_from(KV_POOL, ks, [0, 1])
    b.close()
    with pytest.raises(CacheUsageError):
        b.exists(ks)
    again = harness.backend()
    again.register_pool(KV_POOL, pool)
    assert again.exists(ks).usable_pages == 2


def test_namespaces_never_see_each_other(harness):
    a, other = harness.backend(tenant="a"), harness.backend(tenant="b")
    pool = harness.pool()
    a.register_pool(KV_POOL, pool)
    other.register_pool(KV_POOL, pool)
    ks = keys(2)
    a.set_from(KV_POOL, ks, [0, 1])
    assert other.exists(ks).usable_pages == 0
    assert other.get_into(KV_POOL, ks, [4, 5]).ok == [False, False]


def test_concurrent_writers_leave_every_page_intact(harness):
    pool = harness.pool(pages=32)
    writers = [harness.backend() for _ in range(2)]
    for w in writers:
        w.register_pool(KV_POOL, pool)
    ks = keys(12)
    errors = []

    def write(backend, order):
        try:
            for i in order:
                backend.set_from(KV_POOL, [ks[i]], [i])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(writers[0], range(12))),
               threading.Thread(target=write, args=(writers[1], reversed(range(12))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    reader = harness.backend()
    reader.register_pool(KV_POOL, pool)
    assert reader.get_into(KV_POOL, ks, list(range(16, 28))).ok == [True] * 12
    for i in range(12):
        assert same_page(pool, i, pool, 16 + i)


def test_keys_must_be_page_hashes(harness):
    b = harness.backend()
    b.register_pool(KV_POOL, harness.pool())
    for bad in ("../../etc/passwd", "a" * 63, "G" * 64):
        with pytest.raises(CacheUsageError):
            b.exists([bad])
    with pytest.raises(CacheUsageError):
        b.get_into("nope", keys(1), [0])


@pytest.mark.takes_down
def test_backend_down_at_run_time_is_a_miss(harness):
    b = harness.backend()
    b.register_pool(KV_POOL, harness.pool())
    ks = keys(2)
    b.set_from(KV_POOL, ks, [0, 1])
    harness.tamper.take_down(b)
    assert b.get_into(KV_POOL, ks, [2, 3]).ok == [False, False]
    assert b.exists(ks).usable_pages == 0
    assert b.set_from(KV_POOL, keys(1, salt=100), [4]).ok == [False]
