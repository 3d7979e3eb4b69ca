"""The L3 side of a rank's cache: attach and detach a backend, prefetch into L2.

A base of HierarchicalCache (the facade callers see); it works on the cache's tree, pools and
counters, and hands prefetch tickets through to the L3 tier (storage_tier), which owns them.
Why a module of its own: attaching (with the L2 relayout L3 needs and a hybrid model's
sliding-window pool) and prefetching (with the L1-only runs it must stage first) are one
concern, apart from the request path's lookup, allocate and finish.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Sequence

from kvtier.backends.base import KV_POOL, StorageBackend
from kvtier.errors import CacheUsageError
from kvtier.policies import MemLayout
from kvtier.tiers.sliding_l3 import SlidingL3
from kvtier.tiers.storage_tier import StorageTier
from kvtier.tiers.storage_types import PrefetchTicket
from kvtier.tiers.tree_node import TreeNode

if TYPE_CHECKING:
    from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)


def depth(node: TreeNode) -> int:
    """Tokens of the prefix `node` ends."""
    return sum(len(n.key) for n in node.path_to_root())


class CacheL3:
    """L3 methods of HierarchicalCache (see the module docstring)."""

    def attach_storage(self: "HierarchicalCache", backend: StorageBackend) -> None:
        """Use `backend` as L3 (takes ownership: detach closes it)."""
        if not self.hierarchical:
            raise CacheUsageError("the hierarchical cache is off (L1 only): L3 needs L2 to "
                                  "stage its pages; enable it to attach a backend")
        if self.storage is not None:
            raise CacheUsageError("an L3 backend is already attached; detach it first")
        self.use_head_major_host()  # L3 moves one run of bytes per KV head
        backend.register_pool(KV_POOL, self.host_pool)
        sliding = (SlidingL3(backend, self.host_pool.sidecar, self.tree, self.spec.window_pages,
                             self.config.storage_batch_pages)
                   if self.sliding is not None else None)
        self.storage = StorageTier(backend, self.tree, self.host_pool.allocator, self.config,
                                   self.namespace, self._alloc_host,
                                   directory=self.directory, sliding=sliding)
        log.info("L3 attached: %s (%s)", backend.kind, backend.capabilities)
        self._back_up_host_pages()  # what L2 holds goes to the new backend too

    def use_head_major_host(self: "HierarchicalCache") -> None:
        """Hold L2 in `page_head` from now on (L3 and a hand-off across TP sizes move one run
        of bytes per KV head), after the copies in flight have landed."""
        self.flush()  # back up only L2 copies that have landed (and drop the ones that failed)
        if not self.host_pool.layout.is_head_major:
            self.host_pool.relayout(MemLayout.PAGE_HEAD)
            self.config = dataclasses.replace(self.config, mem_layout=MemLayout.PAGE_HEAD)

    def storage_emptied(self: "HierarchicalCache") -> None:
        """The attached L3 was emptied behind this rank (its namespace purged): nothing is
        believed stored any more and what L2 holds is backed up again; prefetches go on."""
        if self.storage is None:
            return
        self.flush()
        self.storage.forget_reports()  # written before the purge: gone with it
        self.tree.l3.forget_storage()
        self._back_up_host_pages()

    def _back_up_host_pages(self: "HierarchicalCache") -> None:
        for node in self.tree.nodes():
            if node.host_value is not None:
                self._back_up_to_storage(node)

    def detach_storage(self: "HierarchicalCache") -> None:
        """Stop using L3: open prefetches are dropped, queued backups finish, nothing leaks."""
        if self.storage is None:
            return
        self.flush()
        self.storage.close()  # aborts its open prefetches first
        self.storage = None
        self.events.tell_stored()
        self.tree.l3.forget_storage()

    def prefetch(self: "HierarchicalCache", tokens: Sequence[int], retry: bool = False,
                 salt: str = "") -> PrefetchTicket | None:
        """Start fetching from L3 what this rank lacks locally (None: nothing worth fetching).
        `retry`: the request asked before and found too little (see StorageTier.prefetch).
        `salt`: the request's cache salt (its pages' keys are of that salt's chain).

        It starts past the deeper of the L1 and L2 matches, so a page in L1 is never read
        from L3 again. The pages that land can only hang below the root or a node in L2 (the
        tree's rule: an L2-only run is complete in L2), so when the match ends in runs that
        are in L1 only (write_back, storage_only, a dropped copy), those runs are copied to
        L2 as the prefetch starts: an L1->L2 copy costs a fraction of the L3 read it saves,
        and it lands long before the read. Without L2 room for them the prefetch is dropped
        (nothing it brings could be placed)."""
        if self.storage is None:
            return None
        self.poll()
        m = self.tree.match_prefix(tokens, touch=False, salt=salt)
        anchor = max(m.last_device_node, m.last_host_node, key=depth)  # one path: the deeper
        ticket = self.storage.prefetch(tokens, depth(anchor) // self.spec.page_size, anchor,
                                       retry)
        if ticket is not None and not self._stage_below_l3(anchor):
            self.storage.abort(ticket)
            return None
        return ticket

    def _stage_below_l3(self: "HierarchicalCache", anchor: TreeNode) -> bool:
        """Give the L1-only runs that end the path to `anchor` L2 copies (root side first),
        so that L3 pages can hang below it; False when L2 has no room for them."""
        tail = []
        node = anchor
        while node.parent is not None and node.host_value is None:
            tail.append(node)
            node = node.parent
        return all(self._copy_to_host(n) for n in reversed(tail))

    def prefetch_ready(self: "HierarchicalCache", ticket: PrefetchTicket, at_admission: bool = False) -> bool:
        """May the request stop waiting for its prefetch? `at_admission`: admission has
        reached it (a best_effort prefetch ends there)."""
        return (ticket.finished or self.storage is None
                or self.storage.ready(ticket, at_admission=at_admission))

    def finish_prefetch(self: "HierarchicalCache", ticket: PrefetchTicket, max_pages: int | None = None) -> int:
        """Insert what landed into L2 (at most `max_pages` pages: what every TP rank landed);
        returns the storage hit length (tokens)."""
        if ticket.finished or self.storage is None:
            return 0
        return self.storage.finish(ticket, max_pages)

    def abort_prefetch(self: "HierarchicalCache", ticket: PrefetchTicket) -> None:
        if not ticket.finished and self.storage is not None:
            self.storage.abort(ticket)
