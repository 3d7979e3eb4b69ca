"""A rank's pin desk: the pinned-prefix calls over its cache's pins (tiers/cache_pins).

`Rank` (actors/rank_actor) owns one and its remote pin calls delegate here. Every rank of an
instance gets the same calls in the same order (actors/instance_pins); answers are values,
never exceptions, since an exception in a rank call counts as a rank fault.
"""
from __future__ import annotations

import logging
from typing import Sequence

from kvtier.messages import pack_record
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)


class RankPinDesk:
    """The pins of one rank's cache; rank 0 also extends in L3 the pins hits extended."""

    def __init__(self, cache: HierarchicalCache, rank: int) -> None:
        self._cache = cache
        self._pins = cache.pins
        self.rank = rank

    def held(self, tokens: Sequence[int], salt: str = "") -> int:
        """Whole pages of `tokens` this rank holds in L1 or L2 (the instance pins the MIN)."""
        return self._pins.held_pages([int(t) for t in tokens], salt)

    def pin(self, pin_id: str, tokens: Sequence[int], pages: int, ttl_s: float,
            max_fraction: float, salt: str = "", tenant: str = "") -> bytes:
        """Pin the first `pages` whole pages: a PinOutcome record, or a PinRefusal record (a
        value: an exception would count as a rank fault); actors.step_wire `decode_pin`."""
        return pack_record(self._pins.pin(pin_id, [int(t) for t in tokens], pages, ttl_s,
                                          max_fraction, salt, tenant))

    def unpin(self, pin_id: str) -> bool:
        return self._pins.unpin(pin_id)

    def describe(self) -> list[dict]:
        """The live pins (a read: pins past their TTL are left out here, dropped by the
        step's `refresh`)."""
        return [p for p in self._pins.describe() if p["expires_in_s"] > 0]

    def figures(self) -> dict:
        """The pins' figures, for metrics (a read)."""
        _, device, host = self._pins.pinned_pages()
        return {"pins": len(self._pins), "device_pages": device, "host_pages": host}

    def refresh(self) -> None:
        """The step's pin upkeep: drop expired pins; rank 0 extends in L3 the pins that hits
        here extended (a hit in L2 never asks L3)."""
        self._pins.expire()
        refreshed = self._pins.take_refreshed()
        if refreshed and self.rank == 0:
            try:
                self._cache.extend_l3_pins(refreshed)
            except Exception as exc:  # noqa: BLE001 - the L3 pin lapses at its TTL at worst
                log.warning("extending %d L3 pins failed (%s)", len(refreshed), exc)
