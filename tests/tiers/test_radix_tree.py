"""HiRadixTree behaviour on small, explicit cases (the property tests cover random ones)."""
import pytest

from kvtier.errors import AllocatorError, CacheUsageError
from kvtier.tiers.allocator import PageAllocator
from kvtier.tiers.load_back import plan_load_back
from kvtier.tiers.radix_tree import HiRadixTree
from kvtier.tiers.tree_types import LoadRefusal


def make(page=4, dev=16, host=32):
    d, h = PageAllocator(dev), PageAllocator(host)
    return HiRadixTree(page, d, h), d, h


def serve(tree, dev, tokens):
    m = tree.match_prefix(tokens)
    need = -(-len(tokens) // tree.page_size) - len(m.device_indices)
    pages = dev.alloc(need)
    res = tree.insert(tokens, m.device_indices + pages)
    dev.free(res.unused_pages)
    return res


def test_empty_and_short_prompts_are_plain_misses():
    tree, dev, _ = make()
    for tokens in ([], [1], [1, 2, 3]):
        m = tree.match_prefix(tokens)
        assert m.device_indices == [] and m.host_hit_length == 0
        assert m.last_device_node is tree.root and m.last_host_node is tree.root


def test_match_is_page_aligned_and_splits_nodes():
    tree, dev, _ = make()
    serve(tree, dev, list(range(12)))  # 3 pages, one node
    assert tree.stats().num_nodes == 2
    m = tree.match_prefix([0, 1, 2, 3, 4, 5, 6, 7, 99, 99, 99, 99, 5])
    assert m.device_hit_length == 8  # 2 of 3 pages
    assert tree.stats().num_nodes == 3  # split at the page boundary
    m = tree.match_prefix([0, 1, 2, 3, 4, 5, 6])  # partial page never matches
    assert m.device_hit_length == 4


def test_insert_returns_duplicate_and_tail_pages():
    tree, dev, _ = make()
    serve(tree, dev, list(range(8)))
    mine = dev.alloc(3)  # recomputed the 2 stored pages and a partial third
    res = tree.insert(list(range(10)), mine)
    assert res.prefix_pages == 2 and res.new_pages == 0
    assert sorted(res.unused_pages) == sorted(mine)  # both duplicates and the tail page
    dev.free(res.unused_pages)
    assert dev.num_used == 2


def test_insert_checks_page_count():
    tree, dev, _ = make()
    with pytest.raises(CacheUsageError, match="need 3 page ids"):
        tree.insert(list(range(9)), [0, 1])


def test_lock_protects_and_unlock_without_lock_raises():
    tree, dev, _ = make(dev=4)
    res = serve(tree, dev, list(range(16)))
    tree.lock(res.last_node)
    assert tree.stats().device_protected_pages == 4 and tree.stats().device_evictable_pages == 0
    assert tree.evict_device(4).freed_pages == 0
    tree.unlock(res.last_node)
    assert tree.stats().device_evictable_pages == 4
    with pytest.raises(CacheUsageError):
        tree.unlock(res.last_node)


def test_lru_evicts_least_recent_leaf_first_and_demotes_backed_up_runs():
    tree, dev, host = make(dev=8)
    a = serve(tree, dev, [1] * 8).last_node
    b = serve(tree, dev, [2] * 8).last_node
    tree.set_backup(a, host.alloc(2))
    tree.match_prefix([2] * 8)  # b is now more recent than a
    r = tree.evict_device(1)
    assert (r.demoted_pages, r.dropped_pages) == (2, 0)
    assert a.value is None and a.host_value is not None and b.value is not None
    m = tree.match_prefix([1] * 8)
    assert m.device_indices == [] and m.host_hit_length == 8 and m.last_host_node is a
    r = tree.evict_device(2)
    assert r.dropped_pages == 2 and tree.match_prefix([2] * 8).hit_length == 0


def test_write_back_copies_before_eviction():
    tree, dev, host = make(dev=4)
    copied = []

    def write_back(node):
        pages = host.alloc(len(node.value))
        copied.append((list(node.value), pages))
        return pages

    tree.write_back = write_back
    serve(tree, dev, [7] * 16)
    r = tree.evict_device(4)
    assert r.written_back_pages == 4 and r.demoted_pages == 4 and len(copied) == 1
    assert tree.match_prefix([7] * 16).host_hit_length == 16


def test_host_eviction_only_takes_unprotected_l2_leaves():
    tree, dev, host = make()
    node = serve(tree, dev, [3] * 8).last_node
    tree.set_backup(node, host.alloc(2))
    assert tree.evict_host(2).freed_pages == 0  # still in L1: not an L2 candidate
    tree.evict_device(2)
    tree.protect_host(node)
    assert tree.evict_host(2).freed_pages == 0
    tree.release_host(node)
    assert tree.evict_host(2).freed_pages == 2 and host.num_used == 0
    assert tree.stats().num_nodes == 1


def test_load_back_threshold_quota_and_all_or_nothing():
    tree, dev, host = make(dev=4)
    node = serve(tree, dev, [5] * 12).last_node
    tree.set_backup(node, host.alloc(3))
    tree.evict_device(3)
    m = tree.match_prefix([5] * 12)
    assert plan_load_back(tree, m.last_host_node, threshold_tokens=16) is LoadRefusal.BELOW_THRESHOLD
    assert plan_load_back(tree, m.last_host_node, max_pages=2) is LoadRefusal.OVER_QUOTA
    blocker = serve(tree, dev, [6] * 16).last_node
    tree.lock(blocker)  # L1 full and locked: nothing can be freed
    assert plan_load_back(tree, m.last_host_node) is LoadRefusal.DEVICE_CAPACITY
    assert node.value is None  # all or nothing: nothing changed
    tree.unlock(blocker)
    plan = plan_load_back(tree, m.last_host_node)  # evicts the blocker, then loads
    assert plan.num_tokens == 12 and len(plan.device_pages) == 3
    assert tree.match_prefix([5] * 12).device_hit_length == 12


def test_insert_host_hangs_only_below_backed_up_nodes():
    tree, dev, host = make()
    serve(tree, dev, [1] * 4)  # L1-only parent
    pages = host.alloc(2)
    res = tree.insert_host([1] * 4 + [2] * 4, pages)
    # the parent run adopts an L2 copy, the child is placed below it
    assert res.unused_pages == [] and res.new_pages == 1
    m = tree.match_prefix([1] * 4 + [2] * 4)
    assert m.device_hit_length == 4 and m.host_hit_length == 4


def test_allocator_detects_double_free_and_changes_nothing():
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free(pages[:1])
    with pytest.raises(AllocatorError, match="double free"):
        alloc.free(pages)
    assert alloc.is_allocated(pages[1]) and alloc.num_free == 3
    assert alloc.alloc(5) is None and alloc.num_free == 3
    with pytest.raises(AllocatorError):
        alloc.free([99])


def test_clear_refuses_while_locked():
    tree, dev, _ = make()
    node = serve(tree, dev, [1] * 8).last_node
    tree.lock(node)
    with pytest.raises(CacheUsageError):
        tree.clear()
    tree.unlock(node)
    tree.clear()
    assert dev.num_used == 0


def test_l3_marks_are_written_through_the_tree():
    """The L3 tier marks backups through the tree: storing, ended (complete or not), pages
    that came from L3, and a detach that forgets them; a split copies the mark."""
    from kvtier.tiers.tree_node import NOT_STORED, STORED
    device = PageAllocator(16)
    tree = HiRadixTree(4, device, PageAllocator(16))
    node = tree.insert(list(range(12)), device.alloc(3)).last_node
    tree.l3.mark_storing([node], 7)
    upper = tree.match_prefix(list(range(4))).last_device_node  # splits the node
    assert upper is not node and upper.storage_op == node.storage_op == 7
    tree.l3.end_storing(node, 7, complete=False)
    assert upper.storage_op == node.storage_op == NOT_STORED
    tree.l3.mark_storing([upper, node], 8)
    tree.l3.end_storing(node, 8, complete=True)
    assert upper.storage_op == node.storage_op == STORED
    tree.l3.forget_storage()
    assert upper.storage_op == node.storage_op == NOT_STORED
    tree.l3.mark_stored(node, first_page=1)  # pages 1.. came from L3: the upper run did not
    assert upper.storage_op == NOT_STORED and node.storage_op == STORED
