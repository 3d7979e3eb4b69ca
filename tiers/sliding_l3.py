"""A hybrid model's sliding-window KV in L3: a pool of its own (`swa`) next to the full
layers' pages, backed up with them and fetched only for the trailing window of a prefetch.

What L3 holds of it is asked of the backend page by page (the TRAILING_PAGES rule: a hit
needs only its last `window_pages` pages), so an L3 hit of the full layers is shortened to the
longest length whose window is there too (`usable_end`). Objects are named like the full
layers' (page hash, KV head, part) in their own pool, so any TP size reads them. A page's
sliding objects are written from its L2 slot, when it has one, by the backup that writes its
full layers, and read into fresh L2 slots of the prefetched pages that end the hit.

The L2 pages (and slots) an op touches stay protected until it ends: a backup holds its tree
path like the full layers' backup does; a read that outlives its request keeps its slots out
of circulation (`detach`) until the worker lets go of them.
"""
from __future__ import annotations

import logging
from typing import NamedTuple, Sequence

from kvtier.backends.base import SWA_POOL, StorageBackend
from kvtier.policies import HitPolicy
from kvtier.tiers.radix_tree import HiRadixTree
from kvtier.tiers.sidecar import NO_SLOT, Sidecar
from kvtier.tiers.storage_worker import StorageOp, StorageWorker
from kvtier.tiers.tree_node import TreeNode

log = logging.getLogger(__name__)

READ_WAIT_S = 0.5  # a window is a few pages: its read ends long before this unless L3 hangs
SETTLE_WAIT_S = 0.05


class SlidingFetch(NamedTuple):
    """The window read of one prefetch: its op and the L2 pages whose slots it fills."""

    op: StorageOp
    pages: list[int]


class SlidingL3:
    """The `swa` pool of one rank's L3 backend (see the module docstring)."""

    def __init__(self, backend: StorageBackend, host: Sidecar, tree: HiRadixTree,
                 window_pages: int, batch_pages: int) -> None:
        backend.register_pool(SWA_POOL, host.slots, hit_policy=HitPolicy.TRAILING_PAGES,
                              window_pages=window_pages)
        self.backend, self.host, self.tree = backend, host, tree
        self.window_pages = window_pages
        self.worker = StorageWorker(backend, batch_pages, pool=SWA_POOL)
        self._orphans: list[tuple[StorageOp, list[int]]] = []  # reads still touching slots
        self.backed_up_pages = 0
        self.fetched_pages = 0
        self.failed_pages = 0
        self.lookup_errors = 0

    # ---- prefetch ------------------------------------------------------------------------
    def present(self, keys: Sequence[str]) -> list[bool]:
        """Per page of `keys`: are its sliding objects in L3? All False when asking fails (a
        miss, counted)."""
        try:
            return self.backend.present(list(keys), SWA_POOL)
        except Exception as exc:  # noqa: BLE001 - a failing L3 is a miss, never an error
            self.lookup_errors += 1
            log.warning("L3 sliding-window lookup failed (%s: %s); a miss", type(exc).__name__,
                        exc)
            return [False] * len(keys)

    def usable_end(self, present: Sequence[bool], limit: int) -> int:
        """The longest prefix (at most `limit` pages) of the pages `present` describes (those
        past what L1/L2 hold) whose trailing window has sliding objects in L3; pages before
        them are local, and the cache's own check at admission covers those."""
        for end in range(min(limit, len(present)), 0, -1):
            if all(present[max(0, end - self.window_pages):end]):
                return end
        return 0

    def fetch(self, keys: Sequence[str], host_pages: Sequence[int]) -> SlidingFetch | None:
        """Start reading the window that ends `keys` into slots of the matching `host_pages`
        (None when the L2 sidecar has no room: the hit will be shortened)."""
        lo = max(0, len(keys) - self.window_pages)
        pages = list(host_pages[lo:])
        if not pages or not self.host.assign(pages):
            return None
        slots = [self.host.slot(p) for p in pages]
        return SlidingFetch(self.worker.prefetch(list(keys[lo:]), slots), pages)

    def settle(self, fetch: SlidingFetch | None) -> int:
        """End a window read before its pages are inserted or freed: pages read whole keep
        their slots (cached), the others lose them; returns pages read. A read that does not
        stop in time keeps its slots out of use until it does."""
        if fetch is None:
            return 0
        op = fetch.op
        if not self.worker.settle(op, READ_WAIT_S):
            self.worker.cancel(op)
            if not self.worker.settle(op, SETTLE_WAIT_S):
                self._orphans.append((op, self.host.detach(fetch.pages)))
                self.failed_pages += len(fetch.pages)
                return 0
        done = min(op.done_pages, len(fetch.pages))
        self.host.unlock(fetch.pages)
        self.host.release(fetch.pages[done:])
        self.fetched_pages += done
        self.failed_pages += len(fetch.pages) - done
        return done

    # ---- backup --------------------------------------------------------------------------
    def backup(self, keys: Sequence[str], host_pages: Sequence[int], node: TreeNode) -> None:
        """Write the sliding objects of the pages among `host_pages` that have them; `node`'s
        path stays protected in L2 until the write ends."""
        pairs = [(k, p) for k, p in zip(keys, host_pages) if self.host.slot(p) != NO_SLOT]
        if not pairs:
            return
        pages = [p for _, p in pairs]
        self.host.lock(pages)
        self.tree.protect_host(node)
        self.worker.backup([k for k, _ in pairs], [self.host.slot(p) for p in pages],
                           (node, pages))

    def poll(self) -> None:
        """Release what ended backups held; free slots of reads that finally stopped."""
        for op in self.worker.finished_backups():
            node, pages = op.payload
            self.host.unlock(pages)
            self.tree.release_host(node)
            self.backed_up_pages += op.done_pages
            self.failed_pages += op.num_pages - op.done_pages
        still = []
        for op, slots in self._orphans:
            if op.settled:
                self.host.free_detached(slots)
            else:
                still.append((op, slots))
        self._orphans = still

    def close(self) -> None:
        self.worker.close()
        self.poll()

    def snapshot(self) -> dict:
        return {"l3_backed_up_pages": self.backed_up_pages,
                "l3_fetched_pages": self.fetched_pages, "l3_failed_pages": self.failed_pages,
                "l3_lookup_errors": self.lookup_errors}
