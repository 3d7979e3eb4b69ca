"""The prefill side's transfer: each handed-off request's prompt pages, written from this
rank's L1 pool into the pages its decode rank reserved, once, right after its prefill.

The endpoint (kvtier.backends.transport_base.TransportEndpoint: NIXL or Mooncake) has this
rank's L1 pool registered; the decode rank's pool is named by its `HandoffTarget`. One
write per request moves every region of every page (page-aligned, in one batch); the sums
of what was sent let the decode ranks verify each page.

No write runs past its target's `write_by`: each write is given only the time left before it
(and one that would start later is not started), because the decode rank frees the pages at
its hold's end and gives them to other requests. Whatever a write raises, the send fails
(`HandoffSent.ok` False) and the decode side recomputes; the step goes on.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from kvtier.backends.transport_base import TransportError
from kvtier.engine.handoff import HandoffSent, HandoffTarget
from kvtier.engine.request import FinishReason, Request, pages_for
from kvtier.errors import KvtierError
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.page_exchange import head_regions, pool_regions

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 40.0  # past Mooncake's own 30 s, so its call needs no helper thread


class WriteDeadlinePassed(TransportError):
    """A hand-off write would start after its target's `write_by`: it is not started."""


class HandoffSender:
    """Sends each handed-off request once; `forget` when the scheduler released it.

    `heads`: this rank's KV heads [start, stop) of the model's. A request's targets are every
    decode rank's: with the same heads as this rank (equal TP sizes) its L1 pages go to that
    rank's L1 pages; otherwise its pages are staged through L2 (`page_head`) and each head
    object goes to the decode rank holding that head (kvtier.tiers.page_exchange)."""

    def __init__(self, endpoint: Any, cache: HierarchicalCache, heads: tuple[int, int],
                 timeout_s: float = TRANSFER_TIMEOUT_S,
                 clock: Callable[[], float] = time.time) -> None:
        """`clock`: wall-clock seconds, what `HandoffTarget.write_by` is in (tests inject
        one)."""
        self.endpoint, self.cache, self.timeout_s = endpoint, cache, timeout_s
        self.pages, self.heads, self.clock = cache.exchange, heads, clock
        l1 = self.pages.l1
        endpoint.register(l1.addr, l1.nbytes, l1.device)
        self._host_registered: int | None = None
        self._sent: set[int] = set()  # handed-off requests seen, while they are handed off

    def register_host(self) -> None:
        """Let peers of another TP size stage through this rank's L2 (`page_head`)."""
        l2 = self.pages.l2
        if self._host_registered != l2.addr:
            self.endpoint.register(l2.addr, l2.nbytes, l2.device)
            self._host_registered = l2.addr

    def send_new(self, handed: Iterable[Request]) -> list[HandoffSent]:
        """Transfer every request in `handed` (all the scheduler's handed-off requests) not
        sent yet; one record each. A request no longer in `handed` (released, or its hold
        expired) is forgotten. Only one that reached its token limit goes on decoding: one
        that ended otherwise (its first token a stop token, an error) is not sent, the
        decode side never needs its KV."""
        handed = list(handed)
        self._sent &= {req.id for req in handed}
        out = []
        for req in handed:
            if req.id not in self._sent:
                self._sent.add(req.id)
                if req.finish_reason is FinishReason.LENGTH:
                    out.append(self.send(req))
        return out

    def forget(self, request_id: int) -> None:
        self._sent.discard(request_id)

    @property
    def unreleased(self) -> int:
        """Requests seen handed off and not released yet (0 once every one was)."""
        return len(self._sent)

    def send(self, req: Request) -> HandoffSent:
        targets = req.handoff_to
        assert targets
        hid = targets[0].handoff_id
        pages = req.pages[:pages_for(len(req.prompt), self.cache.spec.page_size)]
        self.pages.settle_l1()  # the prefill's writes must land before the NIC reads them
        failed = HandoffSent(hid, False, (), 0, 0, 0.0, "", self.heads)
        try:
            for t in targets:  # none is written when any is late (nothing to copy either)
                self._time_left_s(t)
            if self._straight(targets) is not None:
                return self._send_pages(targets, pages)
            return self._send_staged(targets, pages)
        except Exception as exc:  # noqa: BLE001 - any failure is a failed send, never a step's
            # (a transport library's own error too: the decode side recomputes either way)
            log.warning("hand-off %s: the transfer failed (%s: %s); the decode side recomputes",
                        hid, type(exc).__name__, exc, exc_info=not isinstance(exc, KvtierError))
            return failed._replace(error=str(exc) or type(exc).__name__)

    def _time_left_s(self, target: HandoffTarget) -> float:
        """How long a write to `target` may run: TRANSFER_TIMEOUT_S, or what is left before
        its `write_by` when that is sooner. Raises WriteDeadlinePassed when nothing is left:
        the decode rank may free the pages before such a write ends."""
        if not target.write_by:
            return self.timeout_s
        left = target.write_by - self.clock()
        if left <= 0:
            raise WriteDeadlinePassed(f"past the write deadline by {-left:.3f} s; not writing "
                                      f"(the decode side may have freed the pages)")
        return min(self.timeout_s, left)

    def plan(self, targets: Sequence[HandoffTarget], pages: Sequence[int],
             staging: Sequence[int] = ()) -> list[tuple[HandoffTarget, np.ndarray, np.ndarray]]:
        """The writes a hand-off of this rank's L1 `pages` makes, one per decode rank written
        to: (target, local rows, remote rows). Staged (other TP sizes), the local rows are
        head objects of the L2 `staging` pages the L1 pages were copied to."""
        straight = self._straight(targets)
        if straight is not None:
            return [(straight, self.pages.l1_regions(pages),
                     pool_regions(self.cache.spec, straight.base_addr, straight.pool_pages,
                                  straight.pages))]
        spec, (lo, hi) = self.cache.spec, self.heads
        writes = []
        for t in targets:
            t_lo, t_hi = t.heads
            heads = range(max(lo, t_lo), min(hi, t_hi))
            if not heads or t.staging is None:
                continue
            local = self.pages.l2_head_regions(hi - lo, staging, [h - lo for h in heads])
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
        wrote = self.endpoint.write(target.peer, local, remote, self._time_left_s(target))
        return HandoffSent(target.handoff_id, True, self.pages.l1_sums(pages), wrote.bytes,
                           wrote.descriptors, wrote.seconds, "", self.heads)

    def _send_staged(self, targets: Sequence[HandoffTarget], pages: list[int]) -> HandoffSent:
        """Other TP sizes: this rank's heads of each page, staged in L2, written head object
        by head object to the decode ranks holding those heads (one write per rank)."""
        cache, (lo, hi) = self.cache, self.heads
        self.register_host()
        staging = cache.allocate_host(len(pages))
        if staging is None:
            raise TransportError(f"no L2 room to stage {len(pages)} pages; raise "
                                 f"--hicache-ratio on the prefill instances")
        try:
            self.pages.copy_to_l2(pages, staging)
            nbytes = descriptors = 0
            seconds = 0.0
            for t, local, remote in self.plan(targets, pages, staging):
                wrote = self.endpoint.write(t.peer, local, remote, self._time_left_s(t))
                nbytes += wrote.bytes
                descriptors += wrote.descriptors
                seconds += wrote.seconds
            sums = self.pages.l2_head_sums(staging, range(hi - lo))
        finally:
            cache.release_host_pages(staging)
        return HandoffSent(targets[0].handoff_id, True, sums, nbytes, descriptors, seconds, "",
                           self.heads, staged=True)
