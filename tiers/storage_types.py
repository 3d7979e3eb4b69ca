"""What the L3 tier hands out and depends on: prefetch tickets, its counters, the page
directory it asks (as a Protocol), and the token prefix of a node."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, Sequence

from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceInfo, NamespaceSpec, PeerOffer
from kvtier.tiers.storage_worker import StorageOp
from kvtier.tiers.tree_node import TreeNode


class DirectoryLookup(Protocol):
    """What a directory lookup answers (kvtier.messages.LookupResult is one)."""

    hit_pages: int  # leading pages published
    lease_id: str  # "" when nothing was leased


class PageDirectoryClient(Protocol):
    """The L3 page directory as a rank sees it: `kvtier.tiers.page_directory.PageDirectory`
    (in-process) and the namespace actor's clients (`NamespaceClient`,
    `FakeNamespaceClient`) all have these methods. Calls may raise (down, timed out)."""

    def report_stored(self, ns: str, hashes: Sequence[str],
                      heads: HeadRange) -> Sequence[str]: ...

    def lookup(self, ns: str, hashes: Sequence[str],
               lease_ttl_s: float = 0.0) -> DirectoryLookup: ...

    def release(self, lease_id: str) -> bool: ...

    def report_missing(self, ns: str, hashes: Sequence[str]) -> int: ...

    def info(self, ns: str) -> NamespaceInfo:
        """The namespace as registered now (its epoch grows when its storage moves); raises
        kvtier.errors.UnknownNamespaceError when the directory does not hold it."""
        ...

    def register(self, spec: NamespaceSpec) -> NamespaceInfo:
        """Register a namespace (idempotent): a rank whose namespace the directory lost
        registers it again."""
        ...

    def refresh_pins(self, ns: str, pin_ids: Sequence[str]) -> int:
        """Hits on pinned pages in a rank's L2 extend those pins in L3 too."""
        ...

    def best_peer(self, ns: str, hashes: Sequence[str], asker: str) -> PeerOffer:
        """The peer other than `asker` holding the longest leading run of `hashes` in L2."""
        ...


class PrefetchSource(enum.Enum):
    """Where a prefetch reads its pages from."""

    STORAGE = "storage"  # L3 (the namespace's storage)
    PEER = "peer"  # another instance's L2 (tiers/peer_fetch.py)


@dataclass
class PrefetchTicket:
    """One request's L3 (or peer) prefetch: give it back to `finish` or `abort` exactly
    once."""

    tokens: tuple
    start_page: int  # index of the first L3 page within `tokens`
    storage_hit_pages: int  # what L3 said it holds past the local hit
    op: StorageOp
    anchor: TreeNode  # protected in L2 until the pages are inserted below it
    timeout_s: float
    finished: bool = False
    lease_id: str = ""  # the directory's lease on the pages being fetched ("" = none)
    sliding: object | None = None  # a hybrid model's window read (SlidingFetch)
    source: PrefetchSource = PrefetchSource.STORAGE

    @property
    def done_pages(self) -> int:
        return self.op.done_pages


@dataclass
class StorageCounters:
    queried_tokens: int = 0
    storage_hit_tokens: int = 0  # L3 said present
    prefetched_tokens: int = 0  # landed and inserted
    prefetch_wait_s: float = 0.0
    unfulfilled_below_threshold_tokens: int = 0
    unfulfilled_host_capacity_tokens: int = 0
    unfulfilled_sliding_window_tokens: int = 0  # L3 held the pages, not their window's sliding KV
    unfulfilled_storage_transfer_tokens: int = 0  # asked for, not landed in time or failed
    backed_up_tokens: int = 0
    backup_failed_tokens: int = 0
    directory_errors: int = 0  # directory calls that failed (lookups count as L3 misses)
    directory_miss_lookups: int = 0  # lookups answered as misses: the directory did not answer
    lookup_errors: int = 0  # backend lookups that failed (counted as L3 misses)
    directory_reported_pages: int = 0  # pages this rank reported stored to the directory
    quarantined_pages: int = 0  # L2 pages a gave-up transfer may still touch: never reused
    retried_lookups: int = 0  # L3 lookups of waiting requests whose prefetch found too little
    retried_hit_tokens: int = 0  # tokens such retries started fetching
    peer_hit_tokens: int = 0  # a peer's L2 held them past the local hit, more than L3 did
    peer_prefetched_tokens: int = 0  # of `prefetched_tokens`: read from a peer's L2
    peer_lookup_errors: int = 0  # directory peer lookups that failed (counted as misses)

    def snapshot(self) -> dict:
        return dict(self.__dict__)


def node_tokens(node: TreeNode) -> tuple:
    """The whole token prefix a node ends (walks to the root)."""
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)
