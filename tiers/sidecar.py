"""The sliding-window layers' KV of a pool's pages, kept only where a query can still see it.

A hybrid model (Gemma-3: five sliding-window layers to one global layer) needs the global
layers' KV for every page of a prefix, but its sliding layers' KV only for the last window
before the position it resumes from. So a pool (L1 or L2) keeps the full-attention layers for
every page, as for a plain model, and the sliding layers in a sidecar: a smaller pool of slots
and a map from the pool's page ids to slots. A page without a slot has lost its sliding KV (a
tombstone): it can still be the inside of a hit, never its trailing window.

Why a map keyed by page id, not by tree node: every mover of pages (the tree, write-through,
write-back, load-back, L3 prefetch and backup) already names pages by id, so the sidecar follows
a page wherever it goes without the tree knowing, and the page allocator's free drops the slot
(`drop`, its free hook). The tree still answers where a page lives; `present` answers whether
its sliding KV is there too, in each tier.

Slots of pages a running request reads or writes are locked; the others are cached and leave in
least-recently-used order when the sidecar needs room (`assign` evicts them).
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol, Sequence

import torch

from kvtier.errors import AllocatorError, ConfigError
from kvtier.kv_spec import KVSpec
from kvtier.policies import IoBackend
from kvtier.tiers.allocator import PageAllocator
from kvtier.tiers.page_copy import CopyPlan, copy_pages

NO_SLOT = -1
# Slots per page of the pool by default. L1's sidecar is as large as the pool, so a prefill
# never waits for a slot (a request locks at most one per page it holds); what requests leave
# there is bounded by their windows all the same (SlidingKV.prune). L2 only caches windows:
# a quarter of its pages, never fewer than a few windows.
DEVICE_SLOT_FRACTION = 1.0
HOST_SLOT_FRACTION = 0.25
MIN_WINDOWS = 4


def sidecar_slots(spec: KVSpec, num_pages: int, slots: int | None = None,
                  fraction: float = HOST_SLOT_FRACTION) -> int:
    """How many slots the sidecar of a pool of `num_pages` pages gets (`slots` when given)."""
    if slots is not None:
        if not isinstance(slots, int) or isinstance(slots, bool) or slots < 1:
            raise ConfigError(f"a sliding-window sidecar needs a positive slot count, got "
                              f"{slots!r}")
        return slots
    floor = min(num_pages, MIN_WINDOWS * (spec.window_pages + 1))
    return max(1, floor, int(num_pages * fraction))


class SlotPool(Protocol):
    """The sidecar's storage: a DevicePool or HostPool over the sliding layers' KVSpec."""

    num_pages: int
    allocator: PageAllocator

    def layer_page_view(self) -> torch.Tensor: ...


class Sidecar:
    """Sliding-window KV slots for the pages of one pool (see the module docstring)."""

    def __init__(self, slots: SlotPool, num_pages: int) -> None:
        self.slots = slots
        self.num_pages = num_pages
        self._slot_of = [NO_SLOT] * num_pages  # page -> slot
        self._locks = [0] * slots.num_pages  # slot -> lock count
        self._cached: OrderedDict[int, int] = OrderedDict()  # unlocked slot -> page, LRU first
        self.evicted_slots = 0  # cached slots given up for room (their pages lost sliding KV)

    # ---- what a page has ----------------------------------------------------------------
    def slot(self, page: int) -> int:
        return self._slot_of[page]

    def present(self, pages: Sequence[int]) -> list[bool]:
        slot_of = self._slot_of
        return [slot_of[p] != NO_SLOT for p in pages]

    def slot_table(self, pages: Sequence[int]) -> list[int]:
        """Slots of `pages`; raises AllocatorError for a page without one (its sliding KV is
        gone: reading it would be wrong KV)."""
        slot_of = self._slot_of
        table = [slot_of[p] for p in pages]
        if NO_SLOT in table:
            missing = [p for p, s in zip(pages, table) if s == NO_SLOT]
            raise AllocatorError(f"pages {missing[:4]} have no sliding-window KV in this pool "
                                 f"but a forward reads them; the caller must prepare their "
                                 f"slots first")
        return table

    @property
    def used_slots(self) -> int:
        return self.slots.num_pages - self.slots.allocator.num_free

    @property
    def locked_slots(self) -> int:
        return self.used_slots - len(self._cached)

    # ---- giving pages slots and taking them away ---------------------------------------
    def room(self) -> int:
        """Slots `assign` could hand out now (free ones and cached ones it would evict)."""
        return self.slots.allocator.num_free + len(self._cached)

    def assign(self, pages: Sequence[int], locked: bool = True) -> bool:
        """Give every page of `pages` without a slot a fresh one (locked, or cached), evicting
        cached slots as needed. All or nothing: False (nothing changed) when the locked slots
        leave too little room. Pages that have a slot keep it (and are locked too)."""
        need = [p for p in dict.fromkeys(pages) if self._slot_of[p] == NO_SLOT]
        alloc = self.slots.allocator
        if len(need) > self.room():
            return False
        if len(need) > alloc.num_free:
            self.evict(len(need) - alloc.num_free)
        fresh = alloc.alloc(len(need))
        assert fresh is not None
        for page, slot in zip(need, fresh):
            self._slot_of[page] = slot
            self._cached[slot] = page
        if locked:
            self.lock(pages)
        return True

    def drop(self, pages: Sequence[int]) -> None:
        """The pages left the pool (its allocator freed them): their slots go too."""
        slot_of, freed = self._slot_of, []
        for p in pages:
            s = slot_of[p]
            if s != NO_SLOT:
                slot_of[p] = NO_SLOT
                self._locks[s] = 0
                self._cached.pop(s, None)
                freed.append(s)
        if freed:
            self.slots.allocator.free(freed)

    def release(self, pages: Sequence[int]) -> int:
        """Drop the sliding KV of `pages` on purpose (it fell out of every window a reader
        needs); returns how many slots were freed. Locked slots stay."""
        gone = [p for p in pages if self._slot_of[p] != NO_SLOT
                and self._locks[self._slot_of[p]] == 0]
        self.drop(gone)
        return len(gone)

    def detach(self, pages: Sequence[int]) -> list[int]:
        """Take the slots of `pages` away from them without freeing the slots (an L3 read
        that may still write them: they are freed with `free_detached` once it stops)."""
        slots = []
        for p in pages:
            s = self._slot_of[p]
            if s != NO_SLOT:
                self._slot_of[p] = NO_SLOT
                self._locks[s] = 0
                self._cached.pop(s, None)
                slots.append(s)
        return slots

    def free_detached(self, slots: Sequence[int]) -> None:
        self.slots.allocator.free(slots)

    def evict(self, num_slots: int) -> int:
        """Free up to `num_slots` cached slots, least recently used first."""
        freed = 0
        while freed < num_slots and self._cached:
            slot, page = self._cached.popitem(last=False)
            self._slot_of[page] = NO_SLOT
            self.slots.allocator.free([slot])
            freed += 1
        self.evicted_slots += freed
        return freed

    # ---- readers ------------------------------------------------------------------------
    def lock(self, pages: Sequence[int]) -> list[int]:
        """Keep the slots of `pages` (those that have one) until `unlock`; returns the pages
        locked (the ones to unlock)."""
        locked = []
        for p in pages:
            s = self._slot_of[p]
            if s != NO_SLOT:
                self._locks[s] += 1
                self._cached.pop(s, None)
                locked.append(p)
        return locked

    def unlock(self, pages: Sequence[int]) -> None:
        """Undo `lock`; a slot nobody holds becomes the most recently used cached one. Pages
        whose slot went in the meantime (the page was freed) are skipped."""
        for p in pages:
            s = self._slot_of[p]
            if s == NO_SLOT:
                continue
            if self._locks[s] <= 0:
                raise AllocatorError(f"unlock of page {p}'s sliding-window slot {s}, which is "
                                     f"not locked: unbalanced lock/unlock")
            self._locks[s] -= 1
            if self._locks[s] == 0:
                self._cached[s] = p

    def touch(self, pages: Sequence[int]) -> None:
        """Mark the cached slots of `pages` as just used."""
        for p in pages:
            s = self._slot_of[p]
            if s in self._cached:
                self._cached.move_to_end(s)

    def audit(self) -> tuple[int, int]:
        """(slots held by no page, locked slots): both 0 when nothing runs."""
        mapped = {s for s in self._slot_of if s != NO_SLOT}
        stray = len(set(self.slots.allocator.allocated_pages()) - mapped)  # detached too
        return stray, sum(1 for n in self._locks if n)


def copy_sidecar(src: Sidecar, dst: Sidecar, src_pages: Sequence[int],
                 dst_pages: Sequence[int], backend: IoBackend = IoBackend.KERNEL) -> int:
    """Copy the sliding KV of `src_pages` (those that have it) to `dst_pages` of another
    pool, giving them cached slots there; returns pages copied. Synchronous: a window is a
    few pages of a few layers, and the full layers' copy of the same pages is what takes
    time. A page `dst` has no room for stays without sliding KV there."""
    pairs = [(sp, dp) for sp, dp in zip(src_pages, dst_pages) if src.slot(sp) != NO_SLOT]
    kept = [dp for _, dp in pairs if dst.slot(dp) != NO_SLOT]
    dst.lock(kept)  # overwritten in place: not evicted to make room for the others
    try:
        room = dst.room()
        need = [dp for _, dp in pairs if dst.slot(dp) == NO_SLOT]
        if len(need) > room:  # keep the trailing pages: a hit's window is at its end
            drop = set(need[:len(need) - room])
            pairs = [(sp, dp) for sp, dp in pairs if dp not in drop]
            need = need[len(need) - room:]
        placed = dst.assign(need, locked=False)
        assert placed, "room() said these fit"
    finally:
        dst.unlock(kept)
    if not pairs:
        return 0
    plan = CopyPlan.build([src.slot(sp) for sp, _ in pairs], [dst.slot(dp) for _, dp in pairs],
                          src.slots.num_pages, dst.slots.num_pages)
    copy_pages(src.slots.layer_page_view(), dst.slots.layer_page_view(), plan, backend)
    return len(pairs)
