"""The prefill side's transfer: each handed-off request's prompt pages, written from this
rank's L1 pool into the pages its decode rank reserved, once, right after its prefill.

The endpoint (kvtier.backends.handoff_base.HandoffEndpoint: NIXL or Mooncake) has this
rank's L1 pool registered; the decode rank's pool is named by its `HandoffTarget`. One
write per request moves every region of every page (page-aligned, in one batch); the sums
of what was sent let the decode ranks verify each page.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Iterable, Sequence

import numpy as np

import torch

from kvtier.backends.handoff_base import HandoffTransferError
from kvtier.engine.handoff import HandoffSent, HandoffTarget, page_sums, pool_regions
from kvtier.engine.handoff_staging import copy_to_host, head_regions, head_sums
from kvtier.engine.request import Request, pages_for
from kvtier.errors import KvtierError
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 40.0  # past Mooncake's own 30 s, so its call needs no helper thread


class HandoffSender:
    """Sends each handed-off request once; `forget` when the scheduler released it.

    `heads`: this rank's KV heads [start, stop) of the model's. A request's targets are every
    decode rank's: with the same heads as this rank (equal TP sizes) its L1 pages go to that
    rank's L1 pages; otherwise its pages are staged through L2 (`page_head`) and each head
    object goes to the decode rank holding that head (kvtier.engine.handoff_staging)."""

    def __init__(self, endpoint: Any, cache: HierarchicalCache, heads: tuple[int, int],
                 timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        self.endpoint, self.cache, self.timeout_s = endpoint, cache, timeout_s
        self.pool, self.heads = cache.device_pool, heads
        kv = self.pool.kv
        endpoint.register(kv.data_ptr(), kv.numel() * kv.element_size(), str(kv.device))
        self._host_registered: int | None = None
        self._sent: set[int] = set()

    def register_host(self) -> None:
        """Let peers of another TP size stage through this rank's L2 (`page_head`)."""
        kv = self.cache.host_pool.kv
        if self._host_registered != kv.data_ptr():
            self.endpoint.register(kv.data_ptr(), kv.numel() * kv.element_size(), "cpu")
            self._host_registered = kv.data_ptr()

    def send_new(self, handed: Iterable[Request]) -> list[HandoffSent]:
        """Transfer every request in `handed` not sent yet; one record each."""
        out = []
        for req in handed:
            if req.id not in self._sent:
                self._sent.add(req.id)
                out.append(self.send(req))
        return out

    def forget(self, request_id: int) -> None:
        self._sent.discard(request_id)

    def send(self, req: Request) -> HandoffSent:
        targets = req.handoff_to
        assert targets
        hid = targets[0].handoff_id
        pages = req.pages[:pages_for(len(req.prompt), self.pool.spec.page_size)]
        if self.pool.kv.is_cuda:  # the prefill's writes must land before the NIC reads them
            torch.cuda.current_stream(self.pool.kv.device).synchronize()
        failed = HandoffSent(hid, False, (), 0, 0, 0.0, "", self.heads)
        if any(t.write_by and time.time() > t.write_by for t in targets):
            log.warning("hand-off %s: past its write deadline; not writing (the decode side "
                        "may have freed the pages)", hid)
            return failed._replace(error="past the write deadline")
        try:
            if self._straight(targets) is not None:
                return self._send_pages(targets, pages)
            return self._send_staged(targets, pages)
        except KvtierError as exc:
            log.warning("hand-off %s: the transfer failed (%s); the decode side recomputes",
                        hid, exc)
            return failed._replace(error=str(exc))

    def plan(self, targets: Sequence[HandoffTarget], pages: Sequence[int],
             staging: Sequence[int] = ()) -> list[tuple[HandoffTarget, np.ndarray, np.ndarray]]:
        """The writes a hand-off of this rank's L1 `pages` makes, one per decode rank written
        to: (target, local rows, remote rows). Staged (other TP sizes), the local rows are
        head objects of the L2 `staging` pages the L1 pages were copied to."""
        straight = self._straight(targets)
        if straight is not None:
            spec, kv = self.pool.spec, self.pool.kv
            return [(straight, pool_regions(spec, kv.data_ptr(), self.pool.num_pages, pages),
                     pool_regions(spec, straight.base_addr, straight.pool_pages,
                                  straight.pages))]
        host, spec, (lo, hi) = self.cache.host_pool, self.cache.spec, self.heads
        writes = []
        for t in targets:
            t_lo, t_hi = t.heads
            heads = range(max(lo, t_lo), min(hi, t_hi))
            if not heads or t.staging is None:
                continue
            local = head_regions(spec, hi - lo, host.kv.data_ptr(), host.num_pages, staging,
                                 [h - lo for h in heads])
            remote = head_regions(spec, t_hi - t_lo, t.staging.base_addr, t.staging.pool_pages,
                                  t.staging.pages, [h - t_lo for h in heads])
            writes.append((t, local, remote))
        return writes

    def raw_writes(self, targets: Sequence[HandoffTarget],
                   through_kvtier: bool = False) -> tuple[int, float]:
        """The benchmark's baseline: the writes a hand-off of as many pages as the targets
        hold makes (this rank's first L1 pages, or first L2 pages staged), by the bare
        transport (or, `through_kvtier`, the checked `write`); (bytes, seconds)."""
        n = len(targets[0].pages)
        if self._straight(targets) is None:
            self.register_host()
        nbytes, seconds = 0, 0.0
        for t, local, remote in self.plan(targets, range(n), range(n)):
            if through_kvtier:
                seconds += self.endpoint.write(t.peer, local, remote, self.timeout_s).seconds
            else:
                seconds += self.endpoint.raw_write(t.peer, local, remote, self.timeout_s)
            nbytes += int(local[:, 1].sum())
        return nbytes, seconds

    def _straight(self, targets: Sequence[HandoffTarget]) -> HandoffTarget | None:
        """The decode rank holding exactly this rank's heads, written L1 to L1 (equal TP
        sizes); None: the hand-off is staged."""
        return next((t for t in targets if t.staging is None and t.heads == self.heads), None)

    def _send_pages(self, targets: Sequence[HandoffTarget], pages: list[int]) -> HandoffSent:
        """Equal TP sizes: L1 pages into the decode rank's L1 pages, in one write."""
        ((target, local, remote),) = self.plan(targets, pages)
        wrote = self.endpoint.write(target.peer, local, remote, self.timeout_s)
        return HandoffSent(target.handoff_id, True, page_sums(self.pool.kv, pages), wrote.bytes,
                           wrote.descriptors, wrote.seconds, "", self.heads)

    def _send_staged(self, targets: Sequence[HandoffTarget], pages: list[int]) -> HandoffSent:
        """Other TP sizes: this rank's heads of each page, staged in L2, written head object
        by head object to the decode ranks holding those heads (one write per rank)."""
        cache, (lo, hi) = self.cache, self.heads
        self.register_host()
        staging = cache.allocate_host(len(pages))
        if staging is None:
            raise HandoffTransferError(f"no L2 room to stage {len(pages)} pages; raise "
                                       f"--hicache-ratio on the prefill instances")
        try:
            copy_to_host(self.pool, cache.host_pool, pages, staging)
            nbytes = descriptors = 0
            seconds = 0.0
            for t, local, remote in self.plan(targets, pages, staging):
                wrote = self.endpoint.write(t.peer, local, remote, self.timeout_s)
                nbytes += wrote.bytes
                descriptors += wrote.descriptors
                seconds += wrote.seconds
            sums = head_sums(cache.host_pool, staging, range(hi - lo))
        finally:
            cache.release_host_pages(staging)
        return HandoffSent(targets[0].handoff_id, True, sums, nbytes, descriptors, seconds, "",
                           self.heads, staged=True)
