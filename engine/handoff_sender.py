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
from typing import Any, Iterable

import torch

from kvtier.engine.handoff import HandoffSent, page_sums, pool_regions
from kvtier.engine.request import Request, pages_for
from kvtier.errors import KvtierError
from kvtier.tiers.device_pool import DevicePool

log = logging.getLogger(__name__)

TRANSFER_TIMEOUT_S = 30.0


class HandoffSender:
    """Sends each handed-off request once; `forget` when the scheduler released it."""

    def __init__(self, endpoint: Any, pool: DevicePool,
                 timeout_s: float = TRANSFER_TIMEOUT_S) -> None:
        self.endpoint, self.pool, self.timeout_s = endpoint, pool, timeout_s
        kv = pool.kv
        endpoint.register(kv.data_ptr(), kv.numel() * kv.element_size(), str(kv.device))
        self._sent: set[int] = set()

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
        target = req.handoff_to
        assert target is not None
        spec, kv = self.pool.spec, self.pool.kv
        pages = req.pages[:pages_for(len(req.prompt), spec.page_size)]
        if kv.is_cuda:  # the prefill's writes must have landed before the NIC reads them
            torch.cuda.current_stream(kv.device).synchronize()
        local = pool_regions(spec, kv.data_ptr(), self.pool.num_pages, pages)
        remote = pool_regions(spec, target.base_addr, target.pool_pages, target.pages)
        state = req.sampler.state()
        start = time.perf_counter()
        if target.write_by and time.time() > target.write_by:
            log.warning("hand-off %s: past its write deadline; not writing (the decode side "
                        "may have freed the pages)", target.handoff_id)
            return HandoffSent(target.handoff_id, False, (), 0, 0, 0.0,
                               "past the write deadline", state)
        try:
            wrote = self.endpoint.write(target.peer, local, remote, self.timeout_s)
        except KvtierError as exc:
            log.warning("hand-off %s: the transfer failed (%s); the decode side recomputes",
                        target.handoff_id, exc)
            return HandoffSent(target.handoff_id, False, (), 0, 0,
                               time.perf_counter() - start, str(exc), state)
        sums = page_sums(kv, pages)
        return HandoffSent(target.handoff_id, True, sums, wrote.bytes, wrote.descriptors,
                           wrote.seconds, "", state)
