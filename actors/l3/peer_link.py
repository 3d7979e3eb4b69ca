"""A rank's peer-to-peer L2 (docs/architecture.md, "Peer-to-peer L2"): it lends its L2 pages
to other instances of its namespace and reads theirs, over a transport endpoint of its own.

`Rank` (actors/rank_actor) owns one `RankPeerLink`; its remote `peer_open` and `peer_lend`
delegate here. Opening it (after L3 is attached: the namespace's directory lists who holds
what) registers this rank's L2 pool on a NIXL or Mooncake endpoint, tells the directory how
peers reach this rank (a `PeerRank`: its heads and its actor's name), and lets the cache's
prefetch read from peers (tiers/peer_fetch.py). A reader asks a holder rank where pages lie
with `peer_lend` on that rank's actor (an answer of a few hundred bytes: the page bytes move
by the reader's one-sided read, never through Ray), from its storage worker's thread.

`report_l2`: rank 0 also tells the directory what its L2 holds, from its cache events, for
an instance no serve replica reports for (a driver's own `Instance`: `kvtier demo`, the
benchmarks); a serve replica reports for its instance itself (actors/serve_replica.py).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import ray

from kvtier.actors.l3.l2_reporter import L2Reporter
from kvtier.backends.handoff_base import HandoffEndpoint
from kvtier.backends.handoff_registry import open_endpoint
from kvtier.errors import CacheUsageError
from kvtier.messages import PeerLend, PeerRank
from kvtier.policies import CacheEventKind, CacheTier, HandoffTransportKind
from kvtier.tiers.cache_event_feed import CacheEventListener
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.peer_pages import PeerLender, PeerReadCounters, PeerReader, RawPeerRead
from kvtier.tiers.storage_types import PageDirectoryClient

log = logging.getLogger(__name__)

# A holder rank answers on a thread of its own (LEND_GROUP), waiting at most for a cache call
# in progress, in well under a second on a loaded machine; past this the holder is treated as
# gone: a peer miss.
PEER_ASK_TIMEOUT_S = 10.0
PEER_READ_TIMEOUT_S = 10.0  # one transport read of a batch of pages
MAX_HANDLES = 256  # holder rank actors whose handles are kept


class RankPeerLink:
    """One rank's lending and reading of L2 pages between instances."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.endpoint: HandoffEndpoint | None = None
        self.lender: PeerLender | None = None
        self.reader: PeerReader | None = None
        self.reporter: L2Reporter | None = None
        self.holder = ""
        self._handles: dict[str, Any] = {}
        self._lock = threading.Lock()  # the handle cache (the worker thread asks)
        # lend runs on the actor's lending thread: open and close swap the lender and close
        # the endpoint only while no lend uses them (taken before the cache's guard)
        self._lending = threading.Lock()

    @property
    def is_open(self) -> bool:
        return self.endpoint is not None

    def open(self, cache: HierarchicalCache, directory: PageDirectoryClient | None,
             holder: str, transport: HandoffTransportKind, report_l2: bool) -> None:
        """Lend and read L2 pages as holder `holder` over a `transport` endpoint."""
        if directory is None or not cache.l3_attached:
            raise CacheUsageError("peer-to-peer L2 finds holders through the L3 namespace "
                                  "actor's directory: attach L3 with a namespace actor first")
        with self._lending:
            self._close(cache)
            self._open(cache, directory, holder, transport, report_l2)

    def _open(self, cache: HierarchicalCache, directory: PageDirectoryClient, holder: str,
              transport: HandoffTransportKind, report_l2: bool) -> None:
        endpoint = open_endpoint(transport, f"peer-{holder}-{self.rank}")
        try:
            heads = cache.heads
            self.lender = PeerLender(cache, endpoint, heads)
            self.reader = PeerReader(cache, endpoint, heads, self._ask, PEER_READ_TIMEOUT_S)
            cache.attach_peers(self.reader, holder)
            context = ray.get_runtime_context()
            me = PeerRank(self.rank, self.size, heads.start, heads.stop,
                          context.get_actor_name() or "", context.namespace)
            if not me.actor:
                raise CacheUsageError("a rank lends its L2 to peers only as a named actor "
                                      "(create_rank_actor names every rank)")
            ns = cache.namespace.name
            if report_l2 and self.rank == 0:
                self.reporter = L2Reporter(directory, ns, holder)
            directory.register_peer(ns, holder, me)
        except BaseException:
            cache.detach_peers()
            endpoint.close()
            self.lender = self.reader = None
            raise
        self.endpoint, self.holder = endpoint, holder
        log.info("rank %d/%d lends and reads L2 pages as %s over %s", self.rank, self.size,
                 holder, transport.value)

    def listener(self, also: CacheEventListener | None) -> CacheEventListener | None:
        """The cache's event listener: `also` (the router's log, when watched) and this
        rank's L2 reporter, when it reports."""
        reporter = self.reporter
        if reporter is None:
            return also

        def listen(kind: CacheEventKind, tier: CacheTier, page_hashes: Sequence[str]) -> None:
            if also is not None:
                also(kind, tier, page_hashes)
            if tier is CacheTier.HOST and kind is CacheEventKind.STORED:
                reporter.held(page_hashes)
            elif tier is CacheTier.HOST and kind is CacheEventKind.EVICTED:
                reporter.dropped(page_hashes)
        return listen

    def lend(self, tokens: Sequence[int], salt: str, first_page: int, num_pages: int,
             heads: Sequence[int]) -> bytes:
        """A peer asks where pages of a prefix lie in this rank's L2: a PeerLend record."""
        with self._lending:
            if self.lender is None:
                raise CacheUsageError("this rank does not lend its L2 (peer_open was not "
                                      "called or it closed)")
            lent = self.lender.lend(tokens, salt, first_page, num_pages, heads)
        return lent.to_msgpack()

    def counters(self) -> PeerReadCounters:
        """What this rank's reads from peers moved and took so far."""
        if self.reader is None:
            return PeerReadCounters(0, 0, 0, 0, 0)
        return self.reader.counters

    def raw_read(self, cache: HierarchicalCache, directory: PageDirectoryClient,
                 tokens: Sequence[int], salt: str = "") -> RawPeerRead:
        """The benchmark's baseline: the transport alone reading what the best peer holds of
        `tokens` into scratch L2 pages (PeerReader.raw_read); nothing enters the cache."""
        if self.reader is None:
            raise CacheUsageError("this rank reads no peers (peer_open was not called)")
        keys = cache.namespace.page_hashes(tokens, cache.spec.page_size, salt)
        offer = directory.best_peer(cache.namespace.name, keys, self.holder)
        if offer.contact is None or not offer.pages:
            raise CacheUsageError("no peer holds the prompt's first page in L2")
        pages = cache.host_pool.allocator.alloc(offer.pages)
        if pages is None:
            raise CacheUsageError(f"no {offer.pages} free L2 pages to read the baseline into")
        try:
            return self.reader.raw_read(offer.contact, tokens, salt, 0, pages)
        finally:
            cache.host_pool.allocator.free(pages)

    def _ask(self, rank: PeerRank, tokens: list[int], salt: str, first_page: int,
             num_pages: int, heads: tuple[int, ...]) -> PeerLend:
        """Holder rank `rank`'s lend, through its actor (the storage worker's thread)."""
        handle = self._handle(rank)
        try:
            data = ray.get(handle.peer_lend.remote(tokens, salt, first_page, num_pages,
                                                   list(heads)), timeout=PEER_ASK_TIMEOUT_S)
        except BaseException:
            with self._lock:
                self._handles.pop(rank.actor, None)  # a restarted holder has a new actor
            raise
        return PeerLend.from_msgpack(data)

    def _handle(self, rank: PeerRank) -> Any:
        with self._lock:
            handle = self._handles.get(rank.actor)
        if handle is None:
            handle = ray.get_actor(rank.actor, namespace=rank.ray_namespace)
            with self._lock:
                if len(self._handles) >= MAX_HANDLES:
                    self._handles.clear()
                self._handles[rank.actor] = handle
        return handle

    def close(self, cache: HierarchicalCache) -> None:
        """Stop lending and reading (open peer prefetches are aborted; nothing leaks)."""
        with self._lending:
            self._close(cache)

    def _close(self, cache: HierarchicalCache) -> None:
        cache.detach_peers()
        if self.reporter is not None:
            self.reporter.close()
            self.reporter = None
        if self.reader is not None:
            self.reader.close()
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        self.lender = self.reader = None
