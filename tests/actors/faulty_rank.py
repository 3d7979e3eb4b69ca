"""A rank actor that injects faults on request: the tests' subclass of RankCache.

Instances under test run it through `Instance(rank_class=FaultyRankCache)`, so production
modules carry no fault hooks. Ray workers cannot import this file (tests/ is not installed),
so the class travels pickled by value.
"""
from __future__ import annotations

import logging
import os
import sys

import ray.cloudpickle

from kvtier.bench.soak_rank import FlakyDirectory, SoakRankCache
from kvtier.messages import LookupResult

log = logging.getLogger(__name__)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LateDirectory(FlakyDirectory):
    """A directory client whose next `hide` lookups see nothing published yet, as when the
    pages are published between this rank's lookup and another rank's."""

    hide = 0

    def lookup(self, ns, hashes, lease_ttl_s: float = 0.0):
        if self.hide > 0:
            self.hide -= 1
            return LookupResult(ns, 0, "")
        return super().lookup(ns, hashes, lease_ttl_s)


class FaultyRankCache(SoakRankCache):
    """The soak's rank (L3 and directory faults) plus `crash_after`, `refuse_allocations`,
    `publish_late` and `hold_host_pages`."""

    _crash_at: int | None = None
    _refusals: int = 0
    _held: list | None = None

    def _directory(self, l3_actor: str):
        self._flaky = LateDirectory(super(SoakRankCache, self)._directory(l3_actor))
        return self._flaky

    def publish_late(self, lookups: int) -> None:
        """This rank's next `lookups` directory lookups happen before the pages' publication."""
        self._flaky.hide += lookups

    def hold_host_pages(self, keep_free: int) -> int:
        """Take this rank's free L2 pages but `keep_free` (no room for its prefetches);
        `release_host_pages` gives them back. Returns how many are held."""
        alloc = self.engine.cache.host_pool.allocator
        self._held = (self._held or []) + (alloc.alloc(max(0, alloc.num_free - keep_free)) or [])
        return len(self._held)

    def release_host_pages(self) -> None:
        if self._held:
            self.engine.cache.host_pool.allocator.free(self._held)
        self._held = None

    def crash_after(self, steps: int) -> None:
        """Kill this rank's process at the start of its `steps`-th next step (it dies with
        requests in flight while its peers wait in a collective)."""
        self._crash_at = self.steps + steps

    def step(self) -> bytes:
        if self._crash_at is not None and self.steps >= self._crash_at:
            log.error("rank %d: crashing at step %d (injected)", self.rank, self.steps)
            os._exit(1)
        return super().step()

    _crash_in: str | None = None

    def crash_in_next(self, method: str) -> None:
        """Kill this rank's process in its next `method` call ("release_handoff",
        "handoff_cancel"): it dies between steps, in a call the PD driver makes."""
        self._crash_in = method

    def _crash_if_in(self, method: str) -> None:
        if self._crash_in == method:
            log.error("rank %d: crashing in %s (injected)", self.rank, method)
            os._exit(1)

    def release_handoff(self, request_id: int) -> bool:
        self._crash_if_in("release_handoff")
        return super().release_handoff(request_id)

    def handoff_cancel(self, handoff_id: str, linger_s: float = 0.0) -> bool:
        self._crash_if_in("handoff_cancel")
        return super().handoff_cancel(handoff_id, linger_s)

    def hold_handed_for(self, seconds: float) -> None:
        """How long this rank holds a handed-off request's pages for the decode side's word."""
        self.engine.scheduler.handed_hold_s = seconds

    def refuse_allocations(self, count: int) -> None:
        """Make this rank's next `count` L1 allocations fail (a rank-local out-of-memory)."""
        self._refusals += count
        cache = self.engine.cache
        if "allocate" in vars(cache):
            return
        real = cache.allocate

        def allocate(num_pages: int) -> list[int] | None:
            if self._refusals > 0:
                self._refusals -= 1
                log.warning("rank %d: refusing an allocation of %d pages (injected)",
                            self.rank, num_pages)
                return None
            return real(num_pages)

        cache.allocate = allocate  # type: ignore[method-assign]

    def corrupt_l1_page(self, page: int) -> None:
        """Flip bytes of one L1 page in place (a hand-off's page damaged on arrival)."""
        self.engine.cache.device_pool.kv[:, :, page] += 1.0

    def time_out_next_handoff(self) -> None:
        """This rank's next hand-off write times out (a slow or hung link)."""
        from kvtier.backends.handoff_base import HandoffTimeout

        sender = self._sender
        real = sender.endpoint

        class _Stalling:
            def __getattr__(self, name):
                return getattr(real, name)

            def write(self, *args, **kwargs):
                sender.endpoint = real  # once
                raise HandoffTimeout("the write did not finish in time (injected)")

        sender.endpoint = _Stalling()
