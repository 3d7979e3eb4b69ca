"""Results of the hierarchical cache facade: what a request got, and the cache's counters."""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import NamedTuple

from kvtier.tiers.sliding_kv import SlotHold
from kvtier.tiers.tree_node import TreeNode


class RequestLengths(NamedTuple):
    """The five lengths (docs/architecture.md invariant 4), in tokens, logged together per
    request."""

    prefix_len: int  # already in L1
    host_hit_length: int  # L2 candidates after the L1 part
    host_loaded_length: int  # loaded back from L2 this round
    storage_hit_length: int  # prefetched from L3 (0 until an L3 tier is attached)
    extend_len: int  # computed this round

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self._asdict().items())


class CacheLookup(NamedTuple):
    """A matched, locked prefix. Hand it back to `finish` or `abort` exactly once.

    `device_pages` are usable L1 page ids for the first `cached_len` tokens; pages loaded back
    this round are valid once the controller's per-layer waits return.
    """

    num_tokens: int
    device_pages: list[int]
    node: TreeNode  # locked until finish/abort
    prefix_len: int
    host_hit_length: int
    host_loaded_length: int
    load: object | None  # LoadHandle of this round's load-back
    loaded_node: TreeNode | None  # L2 pages protected until the load lands
    sliding: SlotHold | None = None  # a hybrid model's sliding-window slots it holds

    @property
    def cached_len(self) -> int:
        return self.prefix_len + self.host_loaded_length

    def lengths(self, storage_hit_length: int = 0) -> RequestLengths:
        """The five lengths; `storage_hit_length` is what this request's L3 prefetch brought
        into L2 (those pages are part of the L2 hit and loaded back with it)."""
        extend = max(0, self.num_tokens - self.cached_len)
        return RequestLengths(self.prefix_len, self.host_hit_length, self.host_loaded_length,
                              storage_hit_length, extend)


class PrefixPeek(NamedTuple):
    """What a lookup would find now (tokens), without locking or loading anything."""

    device_hit_length: int  # in L1
    host_hit_length: int  # in L2 after the L1 part


class CacheAudit(NamedTuple):
    """What a cache holds outside its tree; all zero once every request has ended and
    copies have settled (a non-zero figure is a leak)."""

    stray_device_pages: int  # L1 pages allocated that no node holds
    stray_host_pages: int  # L2 pages allocated that no node (nor a running L3 read) holds
    orphaned_host_pages: int  # L2 pages held by L3 reads still running after their request
    locked_nodes: int  # nodes with lock_ref > 0
    protected_nodes: int  # nodes with host_ref > 0
    open_prefetches: int  # L3 prefetch tickets not finished or aborted

    @property
    def leaked_pages(self) -> int:
        return self.stray_device_pages + self.stray_host_pages

    @property
    def leaked_locks(self) -> int:
        return self.locked_nodes + self.protected_nodes


@dataclass
class CacheCounters:
    """Monotonic token counts (the reference's metric families, kvtier's names)."""

    lookups: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    loaded_back_tokens: int = 0
    backed_up_tokens: int = 0
    written_back_tokens: int = 0
    evicted_device_tokens: int = 0
    evicted_host_tokens: int = 0
    dropped_backup_tokens: int = 0  # no L2 room for a copy
    failed_backup_tokens: int = 0  # L1->L2 copies that failed (kept in L1 only)
    failed_load_tokens: int = 0  # L2->L1 loads that failed (recomputed)
    unstaged_tokens: int = 0  # storage_only: L2 copies given back once in L1 and L3
    # L2 hits recomputed instead of loaded back, by LoadRefusal reason
    unloaded_below_threshold_tokens: int = 0
    unloaded_over_quota_tokens: int = 0
    unloaded_device_capacity_tokens: int = 0

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}
