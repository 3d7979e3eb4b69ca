"""Results of the hierarchical cache facade: what a request got, and the cache's counters."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import NamedTuple

from kvtier.backends.base import BackendStats
from kvtier.policies import StorageBackendKind
from kvtier.tiers.controller import LoadHandle, TransferStats
from kvtier.tiers.sliding_kv import SlotHold
from kvtier.tiers.storage_types import StorageCounters
from kvtier.tiers.tree_node import TreeNode
from kvtier.tiers.tree_types import LoadRefusal


class RequestLengths(NamedTuple):
    """The five lengths (docs/architecture.md invariant 4; CacheLookup draws them), in tokens,
    logged together per request."""

    prefix_len: int  # already in L1
    host_hit_length: int  # L2 candidates after the L1 part
    host_loaded_length: int  # loaded back from L2 this round
    storage_hit_length: int  # prefetched from L3 (0 until an L3 tier is attached)
    extend_len: int  # computed this round

    def describe(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self._asdict().items())


@dataclass(frozen=True)
class CacheLookup:
    """A matched, locked prefix. Hand it back to `finish`, `commit` or `abort` exactly once.

    The five lengths (tokens) of a request of `num_tokens` tokens, in prompt order (the L2
    hit's deepest part may have come from L3: `storage_hit_length`, which `lengths` takes
    from the request's prefetch)::

        |<---------------------------------- num_tokens ----------------------------------->|
        |<- prefix_len -->|<---------------- host_hit_length ---------------->|
                                                |<--- storage_hit_length ---->|
                          |<--- host_loaded_length ---->|
        |<---------------- cached_len ----------------->|<---------- extend_len ----------->|
        | in L1           | L2 -> L1 this round         | computed this round               |

    - `prefix_len`: the L1 hit; `device_pages` covers it, then the loaded-back pages.
    - `host_hit_length`: the L2 hit after the L1 part (with an L3 prefetch that landed, it
      includes its `storage_hit_length`: prefetched pages reach L1 through L2).
    - `host_loaded_length`: the part of the L2 hit loaded back this round (the rest, refused
      by the load-back policy, is recomputed); valid once the controller's per-layer waits
      return.
    - `cached_len = prefix_len + host_loaded_length`: what the request does not compute.
    - `extend_len = num_tokens - cached_len`: what it computes this round, the part of the
      L2 hit not loaded back included (`lengths`).

    What the lookup holds in the cache (its locked tree node, this round's load-back and the
    L2 run it protects) is the cache's own: private fields no caller reads.
    """

    num_tokens: int
    device_pages: list[int]
    prefix_len: int
    host_hit_length: int
    host_loaded_length: int
    sliding: SlotHold | None = None  # a hybrid model's sliding-window slots it holds
    _node: TreeNode | None = field(default=None, repr=False)  # locked until finish/abort
    _load: LoadHandle | None = field(default=None, repr=False)  # this round's load-back
    _loaded_node: TreeNode | None = field(default=None, repr=False)  # L2 run protected
    # until the load lands

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

    def count_unloaded(self, reason: LoadRefusal, tokens: int) -> None:
        """An L2 hit of `tokens` recomputed instead of loaded back, for `reason`."""
        if reason is LoadRefusal.BELOW_THRESHOLD:
            self.unloaded_below_threshold_tokens += tokens
        elif reason is LoadRefusal.OVER_QUOTA:
            self.unloaded_over_quota_tokens += tokens
        elif reason is LoadRefusal.DEVICE_CAPACITY:
            self.unloaded_device_capacity_tokens += tokens
        # NOTHING_TO_LOAD: no L2 hit, nothing recomputed

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


class L3Snapshot(NamedTuple):
    """The attached L3 at one moment: its backend's kind and counters, and the L3 tier's."""

    kind: StorageBackendKind
    backend: BackendStats  # a copy
    counters: StorageCounters  # a copy


class CacheSnapshot(NamedTuple):
    """One cache's counters and pool use at one moment (copies: later traffic does not
    change them), for metrics and benchmarks."""

    page_size: int
    counters: CacheCounters
    transfers: TransferStats  # the L1<->L2 copies' bytes and seconds
    device_pages: int  # L1 capacity
    free_device_pages: int
    host_pages: int  # L2 capacity
    used_host_pages: int
    host_pinned: bool  # L2 is page-locked host memory
    l3: L3Snapshot | None  # None: no L3 attached
    used_host_sidecar_slots: int = 0  # a hybrid model's sliding-window KV slots in use, L2
    used_device_sidecar_slots: int = 0  # and L1
