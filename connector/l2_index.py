"""The L2 index of a vLLM engine: which page key is in which host-pool slot, on every rank.

A page key is the SHA-256 chain digest of a page-aligned token prefix (kvtier.keys), so a key
names its whole prefix and a dict over keys is a radix tree of pages: a prompt's hit is the run
of its keys found in order. The index lives on vLLM's scheduler side, the only place that sees
every request, and is the only owner of slot assignments; every rank's host pool holds the
same slots (a rank holds its own KV heads of each). A slot is SAVING from the step that asked
the ranks to copy a block into it until every rank reported it saved, then HELD; only HELD
pages are hits, and only HELD pages are evicted (least recently used first).
"""
from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from kvtier.tiers.allocator import PageAllocator


class SlotState(enum.Enum):
    SAVING = "saving"  # the ranks were asked to copy a block in; not a hit yet
    HELD = "held"  # every rank holds its part: a hit, evictable


@dataclass
class _Entry:
    key: str
    state: SlotState


class L2Index:
    """Page keys -> host-pool slots for one engine (all its TP ranks)."""

    def __init__(self, num_slots: int) -> None:
        self._slots = PageAllocator(num_slots)
        self._by_key: dict[str, int] = {}
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # HELD slots, least recent first

    @property
    def num_slots(self) -> int:
        return self._slots.num_pages

    @property
    def held(self) -> int:
        return len(self._lru)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def held_run(self, keys: Sequence[str]) -> list[int]:
        """The slots of the longest leading run of `keys` held in L2."""
        slots = []
        for key in keys:
            slot = self._by_key.get(key)
            if slot is None or self._entries[slot].state is not SlotState.HELD:
                break
            slots.append(slot)
        return slots

    def touch(self, slots: Sequence[int]) -> None:
        """Mark a prefix's slots used now; its deepest page becomes the first to go, so
        eviction trims prefixes from their ends and never orphans a longer run."""
        for slot in reversed(slots):
            if slot in self._lru:
                self._lru.move_to_end(slot)

    def reserve(self, keys: Sequence[str]) -> list[int]:
        """A SAVING slot for each key not already indexed, in order, evicting HELD pages as
        needed; stops early when the pool is full of pages being saved. Returns the slots
        taken, one per key from the first, so the caller saves that many leading keys."""
        taken: list[int] = []
        for key in keys:
            if key in self._by_key:
                raise ValueError(f"page {key[:12]} is already in L2: reserve only new pages")
            slot = self._take_slot()
            if slot is None:
                break
            self._by_key[key] = slot
            self._entries[slot] = _Entry(key, SlotState.SAVING)
            taken.append(slot)
        return taken

    def settle(self, saved: Iterable[int], failed: Iterable[int]) -> None:
        """The ranks' word on SAVING slots: saved ones become HELD, failed ones are freed."""
        for slot in saved:
            entry = self._entries.get(slot)
            if entry is not None and entry.state is SlotState.SAVING:
                entry.state = SlotState.HELD
                self._lru[slot] = None
        for slot in failed:
            entry = self._entries.get(slot)
            if entry is not None and entry.state is SlotState.SAVING:
                self._drop(slot)

    def drop_slots(self, slots: Iterable[int]) -> int:
        """Forget HELD pages (a load from them failed on some rank); returns how many."""
        dropped = 0
        for slot in set(slots):
            entry = self._entries.get(slot)
            if entry is not None and entry.state is SlotState.HELD:
                self._drop(slot)
                dropped += 1
        return dropped

    def clear(self) -> None:
        """Forget every HELD page (a reset); pages being saved settle as usual."""
        for slot in list(self._lru):
            self._drop(slot)

    def _take_slot(self) -> int | None:
        got = self._slots.alloc(1)
        if got is None and self._lru:
            self._drop(next(iter(self._lru)))
            got = self._slots.alloc(1)
        return None if got is None else got[0]

    def _drop(self, slot: int) -> None:
        entry = self._entries.pop(slot)
        del self._by_key[entry.key]
        self._lru.pop(slot, None)
        self._slots.free([slot])
