"""What the page directory keeps per namespace (its pages, leases on them, its counters,
who holds which of its pages in L2)
and per lease.

Plain data, owned by kvtier.tiers.page_directory.PageDirectory (the one writer)."""
from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.messages import NamespaceInfo
from kvtier.tiers.l2_holders import L2Holders
from kvtier.tiers.page_pins import NamespacePins
from kvtier.tiers.page_store import PageStore


@dataclass
class DirectoryCounters:
    leases_granted: int = 0
    leases_expired: int = 0
    evicted_pages: int = 0
    expired_pending_pages: int = 0
    hit_pages: int = 0
    miss_pages: int = 0
    lookups: int = 0
    rebuilt_pages: int = 0
    delete_failures: int = 0
    vanished_pages: int = 0  # published pages a reader found missing or corrupt
    old_format_pages_reclaimed: int = 0  # format-1 pages deleted at rebuilds
    purged_pages: int = 0  # pages deleted by purges


@dataclass
class NamespaceState:
    info: NamespaceInfo
    store: PageStore
    published: OrderedDict[str, None] = field(default_factory=OrderedDict)  # oldest use first
    pending: OrderedDict[str, tuple[set[int], float]] = field(default_factory=OrderedDict)
    leased: Counter[str] = field(default_factory=Counter)  # page -> active leases on it
    counters: DirectoryCounters = field(default_factory=DirectoryCounters)
    pins: NamespacePins = field(default_factory=NamespacePins)  # kept past any quota
    l2: L2Holders = field(default_factory=L2Holders)  # who holds which pages in L2
    needs_pass: bool = False  # the quota may be exceeded: the next eviction pass checks


class Lease(NamedTuple):
    namespace: str
    hashes: tuple[str, ...]
    expires_at: float
