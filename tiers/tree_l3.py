"""What L3 holds of each run of the tree: `TreeNode.storage_op` (NOT_STORED, STORED, or the
id of the backup writing it).

Why apart from the tree's structure: only the L3 tier cares, and it changes these marks only
through this part of the tree (`tree.l3`), never by writing nodes itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.tiers.tree_node import NOT_STORED, STORED, TreeNode

if TYPE_CHECKING:
    from kvtier.tiers.radix_tree import HiRadixTree


class TreeL3Marks:
    """The L3 marks of one HiRadixTree's nodes."""

    def __init__(self, tree: "HiRadixTree") -> None:
        self.tree = tree

    def mark_storing(self, nodes: list[TreeNode], op_id: int) -> None:
        """`nodes` are being written to L3 by backup `op_id` (a split copies the mark)."""
        for n in nodes:
            n.storage_op = op_id

    def end_storing(self, node: TreeNode, op_id: int, complete: bool) -> None:
        """Backup `op_id` of the path to `node` ended: STORED if it wrote every page, else the
        nodes may be backed up again."""
        for n in node.path_to_root():
            if n.storage_op == op_id:
                n.storage_op = STORED if complete else NOT_STORED

    def mark_stored(self, node: TreeNode, first_page: int) -> None:
        """Pages from `first_page` on the path to `node` came from L3: no backup needed."""
        end = sum(len(n.key) for n in node.path_to_root()) // self.tree.page_size
        for n in node.path_to_root():
            end -= len(n.key) // self.tree.page_size
            if end < first_page:
                break
            if n.storage_op == NOT_STORED:
                n.storage_op = STORED

    def forget_storage(self) -> None:
        """L3 was detached: "in L3" meant that backend, and a new one starts empty."""
        for node in self.tree.nodes():
            node.storage_op = NOT_STORED
