"""Which instances hold which pages of one namespace in their L2 (host memory).

The page directory keeps this beside the pages published in L3 (docs/architecture.md, "The
Ray actors"): each instance reports what its L2 gained and lost, from the same cache events
that feed the router (kvtier's own instances through their instance server, vLLM engines
through KvtierConnector's scheduler side), under a holder name of its own. A page held by an
instance is a page another instance could read from it instead of recomputing it.

A holder's listing and its ranks' contacts are a lease. Every call of the holder renews it:
its reporter's reports, an empty one every RENEW_INTERVAL_S when nothing changed
(actors/l3/l2_reporter.py), and its ranks' contact registrations, made again on the same
interval (actors/l3/contact_keeper.py). A holder not heard from for HOLDER_TTL_S is dropped,
pages and contacts: a holder that died without saying so (crashed, killed, cut off) is
offered to readers for at most HOLDER_TTL_S after its last call. Expiry is lazy, checked on
every call with the directory's clock, so no thread runs for it. A holder cut off for longer
comes back whole: its reporter's next report lists everything (the directory answers
UNLISTED to a report of an incarnation it keeps no listing of) and its ranks register again
on their interval.

Each start of a holder is an incarnation (`new_incarnation`; vLLM's instance id for an
engine), carried by every call of all of its processes. A call of a new incarnation of a
holder name replaces the old incarnation's listing and contacts; an incarnation replaced or
forgotten is retired, and nothing of it is taken again (reports, renewals, contacts, a late
`forget`). So a replica of a rolling redeploy that reuses its predecessor's name is never
erased by the predecessor's shutdown.

The listing is a hint, as the router's index is: a report lost or late leaves an entry wrong
until the next one. A reader of a peer's pages verifies what it reads and takes a page gone
as a miss. Memory is bounded per holder (`max_pages_per_holder`, the oldest report goes
first) and in retired incarnations remembered (MAX_RETIRED, the oldest go first).

Plain data, owned by the namespace's `NamespaceState` (the page directory is its one writer).
"""
from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

from kvtier.messages import L2Holding, L2Standing, PeerContact, PeerOffer, PeerRank

log = logging.getLogger(__name__)

MAX_PAGES_PER_HOLDER = 1 << 20  # pages one holder may list (32-byte keys: ~100 MiB at most)
# The holder lease: a live holder calls at least every RENEW_INTERVAL_S; one not heard from
# for HOLDER_TTL_S is dropped. The gap leaves room for a slow directory and a failed call.
HOLDER_TTL_S = 10.0
RENEW_INTERVAL_S = 2.0
MAX_RETIRED = 4096  # retired (holder, incarnation) pairs remembered per namespace


def new_incarnation() -> str:
    """An id for one start of a holder, shared by all of its processes."""
    return secrets.token_hex(8)


@dataclass
class _Lease:
    incarnation: str
    renewed_at: float
    reported: bool = False  # a report of this incarnation was taken since the lease began


class L2Holders:
    """page -> holders and holder -> pages, kept in step; how to reach a holder that lends
    its L2 to peers (its ranks' contacts, `register_peer`); and each holder's lease and
    incarnation (see the module docstring)."""

    def __init__(self, max_pages_per_holder: int = MAX_PAGES_PER_HOLDER,
                 clock: Callable[[], float] = time.monotonic,
                 ttl_s: float = HOLDER_TTL_S) -> None:
        if max_pages_per_holder < 1:
            raise ValueError(f"max_pages_per_holder must be >= 1, got {max_pages_per_holder}")
        self.max_pages_per_holder = max_pages_per_holder
        self._clock, self.ttl_s = clock, ttl_s
        self._by_page: dict[str, set[str]] = {}
        self._by_holder: dict[str, OrderedDict[str, None]] = {}
        self.dropped_entries = 0  # entries pushed out by the per-holder bound
        self.expired_holders = 0  # holders dropped when their lease ran out
        self._contacts: dict[str, dict[int, PeerRank]] = {}  # holder -> rank -> contact
        self._leases: OrderedDict[str, _Lease] = OrderedDict()  # least recently renewed first
        self._retired: OrderedDict[tuple[str, str], None] = OrderedDict()

    def __len__(self) -> int:
        """Pages some live holder holds."""
        self.expire()
        return len(self._by_page)

    @property
    def holders(self) -> int:
        """Live holders that list pages."""
        self.expire()
        return len(self._by_holder)

    @property
    def peers(self) -> int:
        """Live holders reachable as peers (every rank registered)."""
        self.expire()
        return sum(self._reachable(holder) for holder in self._contacts)

    def held_by(self, holder: str) -> int:
        """Pages `holder` lists."""
        self.expire()
        return len(self._by_holder.get(holder, ()))

    def incarnation(self, holder: str) -> str | None:
        """The incarnation of `holder` the directory keeps (None: none, or its lease ran
        out)."""
        self.expire()
        lease = self._leases.get(holder)
        return None if lease is None else lease.incarnation

    # ---- the holders' leases and incarnations ------------------------------------------------
    def expire(self) -> int:
        """Drop every holder whose lease ran out (pages and contacts); how many."""
        cutoff, expired = self._clock() - self.ttl_s, 0
        while self._leases:
            holder, lease = next(iter(self._leases.items()))
            if lease.renewed_at > cutoff:
                break
            pages = self._drop(holder)
            expired += 1
            log.warning("L2 holder %s (incarnation %s) was not heard from for %.0f s: its %d "
                        "listed pages and its contacts are dropped", holder, lease.incarnation,
                        self.ttl_s, pages)
        self.expired_holders += expired
        return expired

    def _admit(self, holder: str, incarnation: str) -> _Lease | None:
        """The lease of `holder`'s `incarnation`, renewed (begun when the directory keeps
        none); None when the incarnation is retired. A new incarnation replaces the old one,
        which is retired."""
        self.expire()
        if (holder, incarnation) in self._retired:
            return None
        lease = self._leases.get(holder)
        if lease is not None and lease.incarnation == incarnation:
            lease.renewed_at = self._clock()
            self._leases.move_to_end(holder)
            return lease
        if lease is not None:
            log.info("L2 holder %s: incarnation %s replaces %s, whose listing and contacts "
                     "are dropped", holder, incarnation, lease.incarnation)
            self._drop(holder)
            self._retire(holder, lease.incarnation)
        lease = self._leases[holder] = _Lease(incarnation, self._clock())
        return lease

    def _retire(self, holder: str, incarnation: str) -> None:
        self._retired[(holder, incarnation)] = None
        self._retired.move_to_end((holder, incarnation))
        while len(self._retired) > MAX_RETIRED:
            self._retired.popitem(last=False)

    def _drop(self, holder: str) -> int:
        """Forget `holder`'s lease, contacts and pages; how many pages."""
        self._leases.pop(holder, None)
        self._contacts.pop(holder, None)
        return self._drop_pages(holder)

    # ---- listings ----------------------------------------------------------------------------
    def apply(self, holder: str, incarnation: str, held: Iterable[str],
              dropped: Iterable[str] = (), replace: bool = False) -> L2Standing:
        """`holder`'s `incarnation` gained `held` and lost `dropped` (`replace`: `held` is
        all it holds); renews its lease. How the report was taken: UNLISTED when the
        directory kept no listing of this incarnation before (its holder should list
        everything next), RETIRED (ignored) for a replaced or forgotten incarnation."""
        lease = self._admit(holder, incarnation)
        if lease is None:
            return L2Standing.RETIRED
        standing = L2Standing.LISTED if lease.reported else L2Standing.UNLISTED
        lease.reported = True
        if replace:
            self._drop_pages(holder)
        pages = self._by_holder.setdefault(holder, OrderedDict())
        for page in dropped:
            if page in pages:
                del pages[page]
                self._unlist(page, holder)
        for page in held:
            if page in pages:
                pages.move_to_end(page)
                continue
            pages[page] = None
            self._by_page.setdefault(page, set()).add(holder)
        while len(pages) > self.max_pages_per_holder:
            oldest, _ = pages.popitem(last=False)
            self._unlist(oldest, holder)
            self.dropped_entries += 1
        if not pages:
            del self._by_holder[holder]
        return standing

    def forget(self, holder: str, incarnation: str) -> int:
        """`holder`'s `incarnation` stopped: drop what it listed and its contacts, unless a
        newer incarnation holds the name; either way the incarnation is retired. How many
        pages were dropped."""
        self.expire()
        lease = self._leases.get(holder)
        self._retire(holder, incarnation)
        if lease is None or lease.incarnation != incarnation:
            return 0
        return self._drop(holder)

    def _drop_pages(self, holder: str) -> int:
        pages = self._by_holder.pop(holder, ())
        for page in pages:
            self._unlist(page, holder)
        return len(pages)

    def leading(self, hashes: Sequence[str]) -> tuple[L2Holding, ...]:
        """For each live holder of `hashes[0]`, how many leading pages of `hashes` it holds:
        the longest run first (ties by name)."""
        self.expire()
        runs: dict[str, int] = {}
        alive = set(self._by_page.get(hashes[0], ())) if hashes else set()
        for i, page in enumerate(hashes):
            if not alive:
                break
            has = self._by_page.get(page, set())
            for gone in alive - has:
                runs[gone] = i
            alive &= has
        for holder in alive:
            runs[holder] = len(hashes)
        return tuple(L2Holding(h, n) for h, n in sorted(runs.items(),
                                                        key=lambda item: (-item[1], item[0])))

    # ---- peers -------------------------------------------------------------------------------
    def register_peer(self, holder: str, incarnation: str, rank: PeerRank) -> bool:
        """`holder`'s TP rank `rank.rank` lends its L2 pages to peers, reached as `rank`
        says; renews the holder's lease (False: a retired incarnation, ignored). A rank of
        another TP size than the ranks known replaces them all; the same rank again replaces
        its own (a restarted rank, or a renewal)."""
        if self._admit(holder, incarnation) is None:
            return False
        ranks = self._contacts.setdefault(holder, {})
        if any(r.size != rank.size for r in ranks.values()):
            ranks.clear()
        ranks[rank.rank] = rank
        return True

    def contact(self, namespace: str, holder: str) -> PeerContact | None:
        """How to reach every rank of `holder`, or None until all of its ranks registered
        (or once its lease ran out)."""
        self.expire()
        if not self._reachable(holder):
            return None
        ranks = self._contacts[holder]
        return PeerContact(namespace, holder, tuple(ranks[r] for r in sorted(ranks)))

    def _reachable(self, holder: str) -> bool:
        """Whether every TP rank of `holder` registered."""
        ranks = self._contacts.get(holder)
        return bool(ranks) and len(ranks) == next(iter(ranks.values())).size

    def best_peer(self, namespace: str, hashes: Sequence[str], asker: str) -> PeerOffer:
        """The live holder other than `asker` with the longest leading run of `hashes` among
        those reachable as peers (every rank registered): its run and contact; 0 pages and
        no contact when none holds the first page."""
        for holding in self.leading(hashes):
            if holding.holder == asker:
                continue
            contact = self.contact(namespace, holding.holder)
            if contact is not None:
                return PeerOffer(namespace, holding.pages, contact)
        return PeerOffer(namespace, 0, None)

    def _unlist(self, page: str, holder: str) -> None:
        who = self._by_page.get(page)
        if who is None:
            return
        who.discard(holder)
        if not who:
            del self._by_page[page]
