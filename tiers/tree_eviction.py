"""Eviction policy of the HiRadixTree: which runs leave L1 or L2, in what order, and how.

Why apart from the tree: the tree offers the mechanisms (`demote`, `drop_subtree`,
`remove_host_leaf`, each keeping its sizes and events right); this module is the policy that
picks victims: least recently used unlocked leaves first, demote what has an L2 copy, write
back (write_back policy) or drop what has none. Another policy (frequency-aware admission,
ARC) would replace this module, not the tree.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.tiers.tree_node import TreeNode
from kvtier.tiers.tree_types import EvictResult

if TYPE_CHECKING:
    from kvtier.tiers.radix_tree import HiRadixTree


def evict_device(tree: "HiRadixTree", num_pages: int) -> EvictResult:
    """Free at least `num_pages` L1 pages from least recently used unlocked leaves.

    A run with an L2 copy is demoted (stays matchable from L2); one without is written back
    first when the tree's `write_back` is set and succeeds, else dropped with whatever hangs
    below it.
    """
    freed = demoted = dropped = written = 0
    skipped: list[TreeNode] = []
    queue = tree.ledger.device_lru
    while freed < num_pages:
        node = queue.pop()
        if node is None:
            break
        pages = len(node.value)
        if node.host_value is None and tree.write_back is not None:
            host_pages = tree.write_back(node)
            if host_pages is not None:
                tree.record_write_back(node, host_pages)
                written += pages
        if node.host_value is not None:
            tree.demote(node)
            demoted += pages
        elif node.host_ref:  # an L2 run below it is in use: cannot drop the prefix now
            skipped.append(node)
            continue
        else:
            tree.drop_subtree(node)
            dropped += pages
        freed += pages
    for node in skipped:
        queue.refresh(node)
    return EvictResult(freed, demoted, dropped, written)


def evict_host(tree: "HiRadixTree", num_pages: int) -> EvictResult:
    """Free at least `num_pages` L2 pages from unprotected runs already evicted from L1."""
    freed = 0
    while freed < num_pages:
        node = tree.ledger.host_lru.pop()
        if node is None:
            break
        freed += len(node.host_value)
        tree.remove_host_leaf(node)
    return EvictResult(freed, dropped_pages=freed)

