"""L2 pages lent to a request for its own copy of its KV: swap out of L1, swap back in.

A base of HierarchicalCache (the facade callers see). The engine retracts a decoding request
under L1 pressure (kvtier.engine.retraction): its KV pages, the partial last one included, are
copied into L2 pages the request then holds, outside the tree, until they are copied back into
fresh L1 pages or given back. Pages come from the host pool's allocator like every L2 page
(evicting the tree's unprotected L2 runs for room), so `audit` counts them as stray while a
request holds them and as nothing once it gives them back: a leak shows there.

Why outside the tree: the tree keeps whole pages of a token prefix, shared and evictable; a
retracted request's copy includes its partial last page and must survive until the request
resumes, whatever eviction does. Its whole pages also go to the tree when it leaves L1, as on
any release (and from there to L3 under the write policy); this copy is only the request's.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import torch

from kvtier.errors import TransferError
from kvtier.tiers.cache_types import CacheLookup

if TYPE_CHECKING:
    from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)


class CacheSwap:
    """Swap methods of HierarchicalCache (see the module docstring)."""

    @property
    def can_swap(self: "HierarchicalCache") -> bool:
        """Whether requests may swap at all: there is an L2, and the model is not hybrid (a
        hybrid model's sliding-window KV lives in sidecars whose L2 side keeps only cached
        windows, evictable at any time; swapping it would need slots held for the request,
        which the sidecar does not offer, so such requests are recomputed instead)."""
        return self.hierarchical and self.sliding is None

    def swap_out(self: "HierarchicalCache", device_pages: Sequence[int]) -> list[int] | None:
        """Copy `device_pages` of L1 into fresh L2 pages the caller then holds (one per page,
        in order) and wait for the copy; None (nothing held) when L2 has no room for them
        or the copy failed. The L1 pages may be freed as soon as this returns."""
        if not self.can_swap or not device_pages:
            return None
        host_pages = self._alloc_host(len(device_pages))
        if host_pages is None:
            return None
        if not self.copies.copy_now(device_pages, host_pages):
            log.warning("swapping %d pages out to L2 failed; the request is recomputed",
                        len(device_pages))
            self.host_pool.allocator.free(host_pages)
            return None
        return host_pages

    def swap_in(self: "HierarchicalCache", host_pages: Sequence[int],
                device_pages: Sequence[int]) -> bool:
        """Copy the caller's L2 pages into L1 pages it holds (one per page, in order) and
        wait until they landed; False when the copy failed (the L1 pages hold partial data:
        give them back). The L2 pages stay held: `free_swapped` gives them back."""
        handle = self.controller.load(host_pages, device_pages)
        try:
            handle.wait()
        except TransferError as exc:
            log.warning("swapping %d pages back into L1 failed (%s)", len(host_pages), exc)
            return False
        if self.device_pool.device.type == "cuda":
            # wait() orders the compute stream after the load; the L2 pages may be reused
            # once this returns, so the copy itself must be over.
            torch.cuda.current_stream(self.device_pool.device).synchronize()
        return True

    def free_swapped(self: "HierarchicalCache", host_pages: Sequence[int]) -> None:
        """Give back L2 pages from `swap_out`."""
        self.host_pool.allocator.free(host_pages)

    def bare_lookup(self: "HierarchicalCache", num_tokens: int, salt: str = "") -> CacheLookup:
        """A lookup that matched nothing under `salt` (it locks only the salt's root): what a
        request whose KV came back from its own L2 copy hands to `commit`, `finish` or
        `abort`, which store its pages under that salt."""
        node = self.tree.root_of(salt)
        self.tree.lock(node)
        return CacheLookup(num_tokens, [], node, 0, 0, 0, None, None)
