"""The decode side's reservations: L1 pages held for requests whose KV a prefill instance is
about to write, until the request arrives (`take`), is called off (`cancel`) or its
deadline passes (`expire`: the prefill side died or gave up; the pages go back, none leak).

Pages come from the cache's L1 allocator (evicting cached prefixes as any allocation does)
and are the request's own once taken: the tree never sees them until the request stores
its prompt like any other."""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

from kvtier.engine.request import pages_for
from kvtier.errors import ConfigError
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)

# How long a reservation waits for its request. A prefill rank writes only in its first half
# (HandoffTarget.write_by): each write may run only until then, so no write to the pages can
# still run when they are freed (a Mooncake write given up at write_by ends within Mooncake's
# own 30 s timeout, before the hold's second half is over).
DEFAULT_HOLD_S = 90.0
# A failed write may still be running in the transport (Mooncake's own timeout is 30 s): its
# pages stay held this long after the failure, so no other request's KV is overwritten.
FAILED_WRITE_LINGER_S = 40.0


class Reservation(NamedTuple):
    """What a reservation holds: L1 pages, and L2 staging pages for a prefill instance of
    another TP size (kvtier.tiers.page_exchange)."""

    pages: list[int]
    staged: list[int]


class _Held(NamedTuple):
    held: Reservation
    deadline: float  # monotonic


class DeskCounters(NamedTuple):
    reserved: int  # reservations made
    refused: int   # reservations L1 could not hold
    taken: int     # reservations whose request arrived
    cancelled: int
    expired: int   # reservations freed at their deadline


class HandoffDesk:
    """Reservations of one rank's L1 pages, by hand-off id."""

    def __init__(self, cache: HierarchicalCache) -> None:
        self.cache = cache
        self._held: dict[str, _Held] = {}
        self._lingering: set[str] = set()  # cancelled, freed at their deadline
        self._counts = {name: 0 for name in DeskCounters._fields}

    def reserve(self, handoff_id: str, num_tokens: int, hold_s: float = DEFAULT_HOLD_S,
                staged: bool = False) -> Reservation | None:
        """One L1 page per page of a `num_tokens` prompt (and as many L2 staging pages when
        `staged`), held for `hold_s`; None when L1 (or L2) cannot make room (the request is
        then served mixed)."""
        if handoff_id in self._held:
            raise ConfigError(f"hand-off {handoff_id!r} is reserved already; ids must be unique")
        if num_tokens < 1 or hold_s <= 0:
            raise ConfigError(f"a reservation needs num_tokens >= 1 and hold_s > 0, got "
                              f"{num_tokens} and {hold_s}")
        self.expire()
        n = pages_for(num_tokens, self.cache.spec.page_size)
        pages = self.cache.allocate(n)
        staging: list[int] | None = []
        if pages is not None and staged:
            staging = self.cache.allocate_host(n)
        if pages is None or staging is None:
            self.cache.release_pages(pages or [])
            self._counts["refused"] += 1
            return None
        held = Reservation(list(pages), list(staging))
        self._held[handoff_id] = _Held(held, time.monotonic() + hold_s)
        self._counts["reserved"] += 1
        return held

    def refuse(self) -> None:
        """A reservation refused for the engine's own reasons (counted as one L1 refused)."""
        self._counts["refused"] += 1

    def take(self, handoff_id: str) -> Reservation | None:
        """The reserved pages, now the caller's; None when unknown, cancelled or expired."""
        if handoff_id in self._lingering:
            return None
        held = self._held.pop(handoff_id, None)
        if held is None:
            return None
        self._counts["taken"] += 1
        return held.held

    def cancel(self, handoff_id: str, linger_s: float = 0.0) -> bool:
        """Call a reservation off: its pages are freed now, or after `linger_s` (a write
        to them that failed may still be running)."""
        held = self._held.get(handoff_id)
        if held is None:
            return False
        self._counts["cancelled"] += 1
        if linger_s > 0:
            deadline = min(held.deadline, time.monotonic() + linger_s)
            self._held[handoff_id] = held._replace(deadline=deadline)
            self._lingering.add(handoff_id)
            return True
        del self._held[handoff_id]
        self.free(held.held)
        return True

    def free(self, held: Reservation) -> None:
        self.cache.release_pages(held.pages)
        self.cache.release_host_pages(held.staged)

    def expire(self, now: float | None = None) -> int:
        """Free the reservations whose deadline passed; how many."""
        now = time.monotonic() if now is None else now
        late = [hid for hid, h in self._held.items() if h.deadline <= now]
        for hid in late:
            if hid in self._lingering:
                self._lingering.discard(hid)
            else:
                log.warning("hand-off %s: no request came within its hold; freeing %d L1 "
                            "pages", hid, len(self._held[hid].held.pages))
                self._counts["expired"] += 1
            self.free(self._held.pop(hid).held)
        return len(late)

    def close(self) -> None:
        for hid in list(self._held):
            self.free(self._held.pop(hid).held)
        self._lingering.clear()

    @property
    def held_pages(self) -> int:
        return sum(len(h.held.pages) + len(h.held.staged) for h in self._held.values())

    @property
    def pending(self) -> int:
        return len(self._held)

    @property
    def counters(self) -> DeskCounters:
        return DeskCounters(**self._counts)
