"""A rank's peer-to-peer L2 (docs/architecture.md, "Peer-to-peer L2"): it lends its L2 pages
to other instances of its namespace and reads theirs, over a transport endpoint of its own.

`Rank` (actors/rank_actor) owns one `RankPeerLink`; its remote `peer_open` delegates here.
Opening it (after L3 is attached: the namespace's directory lists who holds what) registers
this rank's L2 pool and the table of what it holds (tiers/peer_table.py) on a NIXL or
Mooncake endpoint, tells the directory how peers reach this rank (a `PeerRank`: its heads,
its endpoint's address, where L2 and the table lie), and lets the cache's prefetch read from
peers (tiers/peer_fetch.py). A reader looks a holder rank's pages up in its table and reads
them with one-sided reads, from its storage worker's thread: no call reaches the holder.

`report_l2`: rank 0 also tells the directory what its L2 holds, from its cache events, for
an instance no serve replica reports for (a driver's own `Instance`: `kvtier demo`, the
benchmarks); a serve replica reports for its instance itself (actors/serve_replica.py).
Every rank keeps its contact registered (actors/l3/contact_keeper.py) under the instance's
`incarnation`, the one its reporter reports under, so the directory drops both together when
the instance stops calling (tiers/l2_holders.py).
"""
from __future__ import annotations

import logging
import os
from typing import Sequence

import ray

from kvtier.actors.l3.contact_keeper import ContactKeeper
from kvtier.actors.l3.l2_reporter import L2Reporter
from kvtier.backends.transport_base import TransportEndpoint
from kvtier.backends.transport_registry import open_endpoint
from kvtier.errors import CacheUsageError
from kvtier.policies import CacheEventKind, CacheTier, Transport
from kvtier.tiers.cache_event_feed import CacheEventListener
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.peer_pages import (CachePool, PeerLender, PeerReadCounters, PeerReader,
                                     RawPeerRead)
from kvtier.tiers.storage_types import PageDirectoryClient

log = logging.getLogger(__name__)

PEER_READ_TIMEOUT_S = 10.0  # one transport read (a table, or a batch of pages)
# Endpoints a rank reads peers with, at most: a large read is split among them, each share
# moved and summed on a thread of its own (tiers/peer_pages.py, LANE_BYTES), since one UCX
# worker copies on one core; no more than the host's cores per rank of the instance
# (`read_lanes`: measured in docs/benchmarks.md, "Peer reads in lanes")
READ_LANES = 2


def read_lanes(tp_size: int, cores: int | None = None) -> int:
    """Endpoints each of an instance's `tp_size` ranks reads with: READ_LANES while the
    host's cores go round (a rank of a TP 3 instance on 2 cores reads with one: its ranks
    already take every core, and more threads only contend)."""
    if cores is None:
        cores = os.cpu_count() or 1
    return max(1, min(READ_LANES, cores // max(1, tp_size)))


class RankPeerLink:
    """One rank's lending and reading of L2 pages between instances."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size
        self.endpoint: TransportEndpoint | None = None
        self.lanes: list[TransportEndpoint] = []  # the reader's other endpoints
        self.lender: PeerLender | None = None
        self.reader: PeerReader | None = None
        self.reporter: L2Reporter | None = None
        self.contact: ContactKeeper | None = None
        self.holder = ""

    @property
    def is_open(self) -> bool:
        return self.endpoint is not None

    def open(self, cache: HierarchicalCache, directory: PageDirectoryClient | None,
             holder: str, incarnation: str, transport: Transport,
             report_l2: bool) -> None:
        """Lend and read L2 pages as holder `holder` (its start `incarnation`, the same on
        every rank) over a `transport` endpoint."""
        if directory is None or not cache.l3_attached:
            raise CacheUsageError("peer-to-peer L2 finds holders through the L3 namespace "
                                  "actor's directory: attach L3 with a namespace actor first")
        self.close(cache)
        endpoint = open_endpoint(transport, f"peer-{holder}-{self.rank}")
        lanes: list[TransportEndpoint] = []
        try:
            lanes += [open_endpoint(transport, f"peer-{holder}-{self.rank}-lane-{k}")
                      for k in range(1, read_lanes(self.size))]
            heads = cache.heads
            pool = CachePool(cache, heads)
            self.lender = PeerLender(pool, endpoint, heads, cache.publish_l2)
            self.reader = PeerReader(pool, endpoint, heads, PEER_READ_TIMEOUT_S, lanes=lanes)
            cache.attach_peers(self.reader, holder)
            context = ray.get_runtime_context()
            me = self.lender.contact(self.rank, self.size, context.get_actor_name() or "",
                                     context.namespace)
            ns = cache.namespace.name
            self.contact = ContactKeeper(directory, ns, holder, incarnation, me)
            if report_l2 and self.rank == 0:
                self.reporter = L2Reporter(directory, ns, holder, incarnation)
        except BaseException:
            cache.detach_peers()
            if self.lender is not None:
                self.lender.close()
            for opened in (*lanes, endpoint):
                opened.close()
            self.lender = self.reader = None
            raise
        self.endpoint, self.lanes, self.holder = endpoint, lanes, holder
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

    def counters(self) -> PeerReadCounters:
        """What this rank's reads from peers moved and took so far."""
        if self.reader is None:
            return PeerReadCounters(0, 0, 0, 0, 0)
        return self.reader.counters

    def raw_read(self, cache: HierarchicalCache, directory: PageDirectoryClient,
                 tokens: Sequence[int], salt: str = "", start_at: float | None = None
                 ) -> RawPeerRead:
        """The benchmark's baseline: the transport alone reading what the best peer holds of
        `tokens` into scratch L2 pages (PeerReader.raw_read, its timed reads from `start_at`
        on); nothing enters the cache."""
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
            return self.reader.raw_read(offer.contact, keys[:offer.pages], pages, start_at)
        finally:
            cache.host_pool.allocator.free(pages)

    def close(self, cache: HierarchicalCache) -> None:
        """Stop lending and reading (open peer prefetches are aborted; nothing leaks)."""
        cache.detach_peers()
        if self.reader is not None:  # its table copies leave the endpoint
            self.reader.close()
        if self.lender is not None:
            self.lender.close()
        if self.contact is not None:
            self.contact.close()
            self.contact = None
        if self.reporter is not None:
            self.reporter.close()
            self.reporter = None
        if self.endpoint is not None:
            for opened in (*self.lanes, self.endpoint):
                opened.close()
            self.endpoint, self.lanes = None, []
        self.lender = self.reader = None
