"""The pinned-prefix calls of a rank actor (tiers/cache_pins over the rank's cache).

A base of `RankCache`, apart so the rank's module keeps to its noun. Every rank of an instance
gets the same calls in the same order (actors/instance_pins); answers are values, never
exceptions, since an exception in a rank call counts as a rank fault.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

from kvtier.messages import pack_record

if TYPE_CHECKING:
    from kvtier.engine.engine import Engine

log = logging.getLogger(__name__)


class RankPins:
    """The rank's pin calls, over `self.engine.cache`."""

    engine: "Engine"
    rank: int

    def pin_held(self, tokens: Sequence[int], salt: str = "") -> int:
        """Whole pages of `tokens` this rank holds in L1 or L2 (the instance pins the MIN)."""
        return self.engine.cache.pins.held_pages([int(t) for t in tokens], salt)

    def pin(self, pin_id: str, tokens: Sequence[int], pages: int, ttl_s: float,
            max_fraction: float, salt: str = "", tenant: str = "") -> bytes:
        """Pin the first `pages` whole pages: a PinOutcome record, or a PinRefusal record (a
        value: an exception would count as a rank fault); actors.step_wire `decode_pin`."""
        out = self.engine.cache.pins.pin(pin_id, [int(t) for t in tokens], pages, ttl_s,
                                         max_fraction, salt, tenant)
        return pack_record(out)

    def unpin(self, pin_id: str) -> bool:
        return self.engine.cache.pins.unpin(pin_id)

    def pins(self) -> list[dict]:
        self._pin_housekeeping()
        return self.engine.cache.pins.describe()

    def _pin_housekeeping(self) -> dict:
        """Drop expired pins; rank 0 extends in L3 the pins that hits here extended (a hit
        in L2 never asks L3). The pins' figures, for metrics."""
        cache = self.engine.cache
        cache.pins.expire()
        refreshed = cache.pins.take_refreshed()
        if refreshed and self.rank == 0 and cache.directory is not None \
                and cache.storage is not None:
            try:
                cache.directory.refresh_pins(cache.namespace.name, refreshed)
            except Exception as exc:  # noqa: BLE001 - the L3 pin lapses at its TTL at worst
                log.warning("extending %d L3 pins failed (%s)", len(refreshed), exc)
        _, device, host = cache.pins.pinned_pages()
        return {"pins": len(cache.pins), "device_pages": device, "host_pages": host}
