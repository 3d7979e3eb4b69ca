"""A hybrid model's sliding-window KV in one rank's cache: which pages of a hit still have it,
its copies along with the full layers' pages, and the slots each request holds.

A hit of n pages resumes at position n*page_size, whose query sees the sliding layers' keys of
the last `window_pages` pages before it. So a hit is usable only up to a length whose trailing
window has sliding KV (`window_ok`); the full layers' KV is needed for every page, as for a
plain model. A request holds the slots of the pages it reads or writes (a `SlotHold`): the hit's
trailing window, then its own pages as it computes them; it lets go of its own pages' slots
(`prune`) once they fall out of both the window it is computing in and the window that ends its
prompt's last whole page (where a resent or continued prompt resumes), so what a request keeps
in the sidecar is bounded by two windows, however long it is.
"""
from __future__ import annotations

from typing import Sequence

from kvtier.errors import CacheUsageError
from kvtier.policies import IoBackend
from kvtier.tiers.sidecar import Sidecar, copy_sidecar


class SlotHold:
    """The sidecar slots one request locked (page ids of L1); released all at once at its end."""

    __slots__ = ("pages",)

    def __init__(self) -> None:
        self.pages: set[int] = set()

    def __len__(self) -> int:
        return len(self.pages)


class SlidingKV:
    """The L1 and L2 sidecars of one rank's cache (see the module docstring)."""

    def __init__(self, device: Sidecar, host: Sidecar, window_pages: int, page_size: int,
                 window: int, io_backend: IoBackend = IoBackend.KERNEL) -> None:
        self.device, self.host = device, host
        self.window_pages, self.page_size, self.window = window_pages, page_size, window
        self.io_backend = io_backend
        self.released_slots = 0  # own pages' slots let go of once out of every window
        self.copied_to_host = 0
        self.loaded_to_device = 0

    # ---- hits -----------------------------------------------------------------------------
    def window_ok(self, pages: Sequence[int], num_pages: int) -> bool:
        """May a hit end after the first `num_pages` of `pages` (L1 ids)? Its trailing window
        must have sliding KV in L1 (0 pages: always)."""
        lo = max(0, num_pages - self.window_pages)
        return all(self.device.present(pages[lo:num_pages]))

    def hold_hit(self, pages: Sequence[int]) -> SlotHold:
        """Lock the slots every page of a hit has (until `trim_hit` or `end`)."""
        hold = SlotHold()
        present = [p for p, ok in zip(pages, self.device.present(pages)) if ok]
        self.device.lock(present)
        self.device.touch(present)
        hold.pages.update(present)
        return hold

    def trim_hit(self, hold: SlotHold, pages: Sequence[int], used_pages: int) -> None:
        """The request uses the first `used_pages` pages of its hit: keep only their trailing
        window's slots."""
        keep = set(pages[max(0, used_pages - self.window_pages):used_pages])
        self._unlock(hold, [p for p in hold.pages if p not in keep])

    # ---- computing ------------------------------------------------------------------------
    def first_needed_page(self, pos: int) -> int:
        """The first page the query at position `pos` (or later) reads in sliding layers."""
        return max(0, pos - self.window + 1) // self.page_size

    def prepare(self, hold: SlotHold, page_table: Sequence[int], start: int, stop: int) -> None:
        """Give the pages positions [start, stop) write fresh slots, held by the request.
        Raises CacheUsageError when the sidecar is full of slots other requests hold."""
        first, last = start // self.page_size, -(-stop // self.page_size)
        pages = [p for p in page_table[first:last] if p not in hold.pages]
        if not self.device.assign(pages):
            raise CacheUsageError(
                f"the sliding-window sidecar of L1 has {self.device.room()} free slots but a "
                f"step needs {len(pages)}: too many long prefills at once for its "
                f"{self.device.slots.num_pages} slots; give L1 more pages or admit fewer "
                f"requests per step")
        hold.pages.update(pages)

    def prune(self, hold: SlotHold, page_table: Sequence[int], own_from: int, pos: int,
              prompt_len: int) -> None:
        """After computing up to `pos`: pages no future query of the request reads lose what
        it held. Its own pages (index >= `own_from`) give their slots up, except the window
        where a resend of its `prompt_len`-token prompt resumes (the prompt's last whole page
        that leaves a token to compute); hit pages are only unlocked."""
        first = self.first_needed_page(pos)
        resume = (prompt_len - 1) // self.page_size
        keep = range(max(0, resume - self.window_pages), max(resume, prompt_len // self.page_size))
        own, shared = [], []
        for i in range(first):
            page = page_table[i]
            if page not in hold.pages or i in keep:
                continue
            (own if i >= own_from else shared).append(page)
        self._unlock(hold, own + shared)
        self.released_slots += self.device.release(own)

    def end(self, hold: SlotHold) -> None:
        """The request ended: what it still holds becomes cached (its pages' tree copies, or
        nothing once they are freed)."""
        self._unlock(hold, list(hold.pages))

    def _unlock(self, hold: SlotHold, pages: Sequence[int]) -> None:
        pages = [p for p in pages if p in hold.pages]
        hold.pages.difference_update(pages)
        self.device.unlock(pages)

    # ---- copies with the full layers' pages ---------------------------------------------
    def copy_to_host(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        self.copied_to_host += copy_sidecar(self.device, self.host, device_pages, host_pages,
                                            self.io_backend)

    def load_to_device(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        self.loaded_to_device += copy_sidecar(self.host, self.device, host_pages, device_pages,
                                              self.io_backend)

    def snapshot(self) -> dict:
        """Slots in use per tier, and the counters."""
        return {"device_slots": self.device.slots.num_pages,
                "device_used_slots": self.device.used_slots,
                "device_locked_slots": self.device.locked_slots,
                "host_slots": self.host.slots.num_pages, "host_used_slots": self.host.used_slots,
                "evicted_device_slots": self.device.evicted_slots,
                "evicted_host_slots": self.host.evicted_slots,
                "released_slots": self.released_slots, "copied_to_host": self.copied_to_host,
                "loaded_to_device": self.loaded_to_device}
