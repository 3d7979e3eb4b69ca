"""Pinned pages of one L3 namespace: kept whatever the quota asks, for a TTL.

The page directory owns one `NamespacePins` per namespace: its quota eviction skips every
pinned page (as it skips leased ones) and its stats count them. A pin covers the leading
published pages of a prefix's hashes; pinned pages may take at most a fraction of the
namespace's quota (none when the namespace is unbounded), and a pin past that is refused
with the room it needs (`PinRoomError`). A lookup that matches pinned pages extends their
pins by another TTL; the directory's clock lapses them (its eviction pass runs every second).

Plain Python, no Ray, not thread-safe: the directory's owner serializes calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, NamedTuple, Sequence

from kvtier.errors import CacheUsageError, PinRoomError

MAX_PINS = 4096  # per namespace
MAX_PIN_TTL_S = 86400.0  # a pin lasts at most a day past its last hit; pin again to go on


def check_ttl(ttl_s: object) -> float:
    """A pin's TTL: a number of seconds, more than 0 and at most MAX_PIN_TTL_S."""
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) \
            or not 0 < ttl_s <= MAX_PIN_TTL_S:
        raise CacheUsageError(f"ttl_s must be a number of seconds in (0, {MAX_PIN_TTL_S:.0f}], "
                              f"got {ttl_s!r}")
    return float(ttl_s)


class L3PinListing(NamedTuple):
    """One pin of an L3 namespace, as /admin/pins lists it."""

    pin_id: str
    tenant: str
    pages: int           # its pages still published
    expires_in_s: float  # 0 once lapsed (dropped at the next pass)


@dataclass
class _Pin:
    hashes: tuple[str, ...]
    ttl_s: float
    expires_at: float
    tenant: str = ""


class NamespacePins:
    """The pins of one namespace and the pages they hold (see the module docstring)."""

    def __init__(self) -> None:
        self._pins: dict[str, _Pin] = {}
        self._pages: dict[str, set[str]] = {}  # page hash -> the pins holding it
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._pins)

    def holds(self, page_hash: str) -> bool:
        return page_hash in self._pages

    def pinned_pages(self, published: Collection[str]) -> int:
        """Pinned pages the namespace still holds."""
        return sum(1 for h in self._pages if h in published)

    def pin(self, pin_id: str, hashes: Sequence[str], ttl_s: float, now: float,
            limit_pages: int | None, where: str, tenant: str = "") -> int:
        """Pin `hashes` (the published ones the caller found) for `ttl_s`; pinning `pin_id`
        again replaces it. `limit_pages`: the most pages pins may hold (None: no bound).
        Returns the pages pinned; raises PinRoomError when they do not fit."""
        check_ttl(ttl_s)
        old = self._pins.pop(pin_id, None)
        if old is not None:
            self._release(pin_id, old)
        if not hashes:
            return 0  # nothing published to keep: no pin
        if old is None and len(self._pins) >= MAX_PINS:
            raise PinRoomError(len(hashes), 0, where, f"at most {MAX_PINS} pins")
        new = sum(1 for h in dict.fromkeys(hashes) if h not in self._pages)
        if limit_pages is not None and new > limit_pages - len(self._pages):
            if old is not None:
                self._hold(pin_id, old)
            raise PinRoomError(new, max(0, limit_pages - len(self._pages)), where)
        self._hold(pin_id, _Pin(tuple(hashes), ttl_s, now + ttl_s, tenant))
        return len(hashes)

    def unpin(self, pin_id: str) -> bool:
        pin = self._pins.pop(pin_id, None)
        if pin is None:
            return False
        self._release(pin_id, pin)
        return True

    def refresh(self, pin_ids: Sequence[str], now: float) -> int:
        """Extend these pins by their TTL from `now`; how many exist."""
        found = [self._pins[i] for i in pin_ids if i in self._pins]
        for pin in found:
            pin.expires_at = now + pin.ttl_s
        return len(found)

    def on_hit(self, hashes: Sequence[str], now: float) -> None:
        """A lookup matched `hashes`: the pins holding any of them live another TTL."""
        if not self._pages:
            return
        ids = set().union(*(self._pages.get(h, ()) for h in hashes))
        self.refresh(sorted(ids), now)

    def expire(self, now: float) -> list[str]:
        """Drop the pins whose TTL ran out; their ids."""
        gone = [i for i, p in self._pins.items() if p.expires_at <= now]
        for pin_id in gone:
            self._release(pin_id, self._pins.pop(pin_id))
        self.expired_total += len(gone)
        return gone

    def describe(self, now: float, published: Collection[str]) -> list[L3PinListing]:
        return [L3PinListing(i, p.tenant, sum(1 for h in p.hashes if h in published),
                             round(max(0.0, p.expires_at - now), 3))
                for i, p in self._pins.items()]

    def clear(self) -> None:
        self._pins.clear()
        self._pages.clear()

    def _hold(self, pin_id: str, pin: _Pin) -> None:
        self._pins[pin_id] = pin
        for h in pin.hashes:
            self._pages.setdefault(h, set()).add(pin_id)

    def _release(self, pin_id: str, pin: _Pin) -> None:
        for h in pin.hashes:
            ids = self._pages.get(h)
            if ids is not None:
                ids.discard(pin_id)
                if not ids:
                    del self._pages[h]
