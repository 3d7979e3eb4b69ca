"""Results the HiRadixTree hands back: named, typed, never bare tuples."""
from __future__ import annotations

import enum
from typing import NamedTuple

from kvtier.tiers.tree_node import TreeNode


class MatchResult(NamedTuple):
    """What a prefix lookup found.

    `device_indices`: L1 page ids of the leading pages already in L1 (page id, not token slot:
    slot = page * page_size + offset). `last_device_node`: deepest matched node in L1 (lock
    it while using the pages). `last_host_node`: deepest matched node backed up in L2.
    `host_hit_length`: tokens after the L1 part that L2 holds (candidates for load-back).
    """

    device_indices: list[int]
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int
    page_size: int

    @property
    def device_hit_length(self) -> int:
        return len(self.device_indices) * self.page_size

    @property
    def hit_length(self) -> int:
        return self.device_hit_length + self.host_hit_length


class InsertResult(NamedTuple):
    """What an insert did with the caller's pages.

    `unused_pages`: the caller's page ids the tree did not take (pages it already held in the
    same tier, and a trailing partial page): the caller frees them. `prefix_pages`: leading
    pages that were already stored before this insert. `last_node`: the node that ends the key.
    """

    unused_pages: list[int]
    prefix_pages: int
    new_pages: int
    last_node: TreeNode


class EvictResult(NamedTuple):
    """Pages an eviction freed, by what happened to their nodes."""

    freed_pages: int
    demoted_pages: int = 0  # L1 copy freed, L2 copy kept
    dropped_pages: int = 0  # gone from every tier
    written_back_pages: int = 0  # copied to L2 on eviction (write_back policy)


class LoadRefusal(enum.Enum):
    """Why an L2 hit is recomputed instead of loaded back (the reference's unfulfilled reasons)."""

    NOTHING_TO_LOAD = "nothing_to_load"
    BELOW_THRESHOLD = "below_threshold"  # shorter than the load-back threshold
    OVER_QUOTA = "over_quota"  # longer than the caller's memory quota
    DEVICE_CAPACITY = "device_capacity"  # L1 could not free enough pages


class LoadBackPlan(NamedTuple):
    """L2 pages to copy into freshly allocated L1 pages, in prefix order."""

    nodes: list[TreeNode]
    host_pages: list[int]
    device_pages: list[int]
    num_tokens: int


class TreeStats(NamedTuple):
    """Sizes in pages, maintained on every change (never by walking the tree)."""

    device_evictable_pages: int
    device_protected_pages: int
    host_evictable_pages: int
    host_protected_pages: int
    num_nodes: int
