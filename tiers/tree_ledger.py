"""The tree's ledger: how many pages each tier holds (evictable / protected) and the queues of
eviction candidates, kept current on every node change.

Why a ledger apart from the tree: sizes and candidate order are asked for on every allocation
(admission, load-back, eviction), so they are maintained incrementally here instead of walking
the tree; the tree tells the ledger before and after it changes a node (`account(-1)`, change,
`account(+1)`, then `refresh`).
"""
from __future__ import annotations

from kvtier.errors import CacheUsageError
from kvtier.tiers.tree_node import LruQueue, TreeNode
from kvtier.tiers.tree_types import TreeStats


class TreeLedger:
    """Page counts by tier and protection, and the L1 / L2 LRU queues of eviction candidates."""

    def __init__(self) -> None:
        self.device_lru = LruQueue("in_device_lru", TreeNode.is_device_candidate)
        self.host_lru = LruQueue("in_host_lru", TreeNode.is_host_candidate)
        self.device_evictable = self.device_protected = 0
        self.host_evictable = self.host_protected = 0
        self.num_nodes = 1  # the root

    def stats(self) -> TreeStats:
        return TreeStats(self.device_evictable, self.device_protected,
                         self.host_evictable, self.host_protected, self.num_nodes)

    def account(self, node: TreeNode, sign: int) -> None:
        """Add (+1) or remove (-1) `node`'s pages from the count that matches its state."""
        if node.value is not None:
            if node.lock_ref:
                self.device_protected += sign * len(node.value)
            else:
                self.device_evictable += sign * len(node.value)
        elif node.host_value is not None:
            if node.host_ref or node.pin_ref:  # pinned L2 pages are not evictable either
                self.host_protected += sign * len(node.host_value)
            else:
                self.host_evictable += sign * len(node.host_value)

    def refresh(self, node: TreeNode) -> None:
        """Re-evaluate `node`'s candidacy in both queues after a change."""
        self.device_lru.refresh(node)
        self.host_lru.refresh(node)

    def discard(self, node: TreeNode) -> None:
        """`node` leaves the tree."""
        self.device_lru.discard(node)
        self.host_lru.discard(node)

    def change_ref(self, node: TreeNode, field: str, delta: int) -> None:
        """Change the path count `field` (lock_ref: L1, host_ref and pin_ref: L2) from `node`
        to the root;
        a node whose count crosses zero moves between the evictable and protected counts."""
        if node.parent is not None and getattr(node, field) + delta < 0:
            raise CacheUsageError(f"{field} of a node would go below zero (release without "
                                  f"a matching lock/protect): {node}")
        while node.parent is not None:
            before = getattr(node, field)
            if before == 0 or before + delta == 0:
                self.account(node, -1)
                setattr(node, field, before + delta)
                self.account(node, +1)
                self.refresh(node)
            else:
                setattr(node, field, before + delta)
            node = node.parent
