"""Load-back planning: which L2-only runs of a matched prefix move back into L1, or why not."""
from __future__ import annotations

from kvtier.tiers.radix_tree import HiRadixTree
from kvtier.tiers.tree_node import TreeNode
from kvtier.tiers.tree_types import LoadBackPlan, LoadRefusal


def plan_load_back(tree: HiRadixTree, node: TreeNode, threshold_tokens: int = 0,
                   max_pages: int | None = None) -> LoadBackPlan | LoadRefusal:
    """Give the L2-only runs from `node` up to its deepest L1 ancestor fresh L1 pages.

    All or nothing: a LoadRefusal when the span is shorter than `threshold_tokens`
    (recomputing is cheaper), longer than `max_pages` (memory quota), or L1 cannot free enough
    pages; nothing changes then. The nodes are in L1 as soon as this returns; the caller
    copies the bytes and makes readers wait per layer.
    """
    nodes: list[TreeNode] = []
    while node.value is None:
        nodes.append(node)
        node = node.parent
    if not nodes:
        return LoadRefusal.NOTHING_TO_LOAD
    nodes.reverse()
    total = sum(len(n.host_value) for n in nodes)
    if total * tree.page_size < threshold_tokens:
        return LoadRefusal.BELOW_THRESHOLD
    if max_pages is not None and total > max_pages:
        return LoadRefusal.OVER_QUOTA
    allocator = tree.device_allocator
    pages = allocator.alloc(total)
    if pages is None:  # evict, then retry once
        tree.lock(node)  # the anchor must survive the eviction we trigger
        tree.protect_host(nodes[-1])  # and so must the L2 pages we are about to load
        try:
            tree.evict_device(total - allocator.num_free)
        finally:
            tree.release_host(nodes[-1])
            tree.unlock(node)
        pages = allocator.alloc(total)
        if pages is None:
            return LoadRefusal.DEVICE_CAPACITY
    tree.restore_to_device(nodes, pages)
    host_pages = [p for n in nodes for p in n.host_value]
    return LoadBackPlan(nodes, host_pages, pages, total * tree.page_size)
