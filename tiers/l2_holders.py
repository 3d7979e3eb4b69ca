"""Which instances hold which pages of one namespace in their L2 (host memory).

The page directory keeps this beside the pages published in L3 (docs/architecture.md, "The
Ray actors"): each instance reports what its L2 gained and lost, from the same cache events
that feed the router (kvtier's own instances through their instance server, vLLM engines
through KvtierConnector's scheduler side), under a holder name of its own. A page held by an
instance is a page another instance could read from it instead of recomputing it.

The listing is a hint, as the router's index is: a report lost or late, or a holder gone
without saying so, leaves an entry that is wrong until the holder reports again (`replace`)
or is forgotten. A reader of a peer's pages verifies what it reads and takes a page gone as a
miss. Memory is bounded per holder (`max_pages_per_holder`, the oldest report goes first).

Plain data, owned by the namespace's `NamespaceState` (the page directory is its one writer).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence

from kvtier.messages import L2Holding, PeerContact, PeerOffer, PeerRank

MAX_PAGES_PER_HOLDER = 1 << 20  # pages one holder may list (32-byte keys: ~100 MiB at most)


class L2Holders:
    """page -> holders and holder -> pages, kept in step; and how to reach a holder that
    lends its L2 to peers (its ranks' contacts, `register_peer`)."""

    def __init__(self, max_pages_per_holder: int = MAX_PAGES_PER_HOLDER) -> None:
        if max_pages_per_holder < 1:
            raise ValueError(f"max_pages_per_holder must be >= 1, got {max_pages_per_holder}")
        self.max_pages_per_holder = max_pages_per_holder
        self._by_page: dict[str, set[str]] = {}
        self._by_holder: dict[str, OrderedDict[str, None]] = {}
        self.dropped_entries = 0  # entries pushed out by the per-holder bound
        self._contacts: dict[str, dict[int, PeerRank]] = {}  # holder -> rank -> contact

    def __len__(self) -> int:
        """Pages some holder holds."""
        return len(self._by_page)

    @property
    def holders(self) -> int:
        return len(self._by_holder)

    @property
    def peers(self) -> int:
        """Holders reachable as peers (every rank registered)."""
        return sum(self._reachable(holder) for holder in self._contacts)

    def held_by(self, holder: str) -> int:
        """Pages `holder` lists."""
        return len(self._by_holder.get(holder, ()))

    def apply(self, holder: str, held: Iterable[str], dropped: Iterable[str] = (),
              replace: bool = False) -> None:
        """`holder` gained `held` and lost `dropped`; `replace`: `held` is all it holds."""
        if replace:
            self._forget_pages(holder)
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

    def forget(self, holder: str) -> int:
        """Drop everything `holder` listed (it stopped, or restarted empty), and its contact;
        how many pages."""
        self._contacts.pop(holder, None)
        return self._forget_pages(holder)

    def _forget_pages(self, holder: str) -> int:
        pages = self._by_holder.pop(holder, None)
        if not pages:
            return 0
        for page in pages:
            self._unlist(page, holder)
        return len(pages)

    def leading(self, hashes: Sequence[str]) -> tuple[L2Holding, ...]:
        """For each holder of `hashes[0]`, how many leading pages of `hashes` it holds: the
        longest run first (ties by name)."""
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
    def register_peer(self, holder: str, rank: PeerRank) -> None:
        """`holder`'s TP rank `rank.rank` lends its L2 pages to peers, reached as `rank`
        says. A rank of another TP size than the ranks known replaces them all (the holder
        restarted at a new size); the same rank again replaces its own (a restarted rank)."""
        ranks = self._contacts.setdefault(holder, {})
        if any(r.size != rank.size for r in ranks.values()):
            ranks.clear()
        ranks[rank.rank] = rank

    def contact(self, namespace: str, holder: str) -> PeerContact | None:
        """How to reach every rank of `holder`, or None until all of its ranks registered."""
        if not self._reachable(holder):
            return None
        ranks = self._contacts[holder]
        return PeerContact(namespace, holder, tuple(ranks[r] for r in sorted(ranks)))

    def _reachable(self, holder: str) -> bool:
        """Whether every TP rank of `holder` registered."""
        ranks = self._contacts.get(holder)
        return bool(ranks) and len(ranks) == next(iter(ranks.values())).size

    def best_peer(self, namespace: str, hashes: Sequence[str], asker: str) -> PeerOffer:
        """The holder other than `asker` with the longest leading run of `hashes` among those
        reachable as peers (every rank registered): its run and contact; 0 pages and no
        contact when none holds the first page."""
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
