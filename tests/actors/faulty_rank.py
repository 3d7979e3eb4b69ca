"""A rank actor that injects faults on request: the tests' subclass of Rank.

Instances under test run it through `Instance(rank_class=FaultyRank)`, so production
modules carry no fault hooks. Every fault that takes effect is counted (`faults_fired`), so
a test asserts that the fault it injected happened, not only that the answers came out
right. Ray workers cannot import this file (tests/ is not installed), so the class travels
pickled by value. Tests call its methods on one rank through `Instance.on_rank`.
"""
from __future__ import annotations

import logging
import os
import sys
from collections import Counter

import ray.cloudpickle

from kvtier.bench.soak_rank import FlakyDirectory, SoakRank
from kvtier.messages import LookupResult

log = logging.getLogger(__name__)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class LateDirectory(FlakyDirectory):
    """A directory client whose next `hide` lookups see nothing published yet, as when the
    pages are published between this rank's lookup and another rank's."""

    hide = 0
    hidden = 0  # lookups answered as before the publication so far

    def lookup(self, ns, hashes, lease_ttl_s: float = 0.0):
        if self.hide > 0:
            self.hide -= 1
            self.hidden += 1
            return LookupResult(ns, 0, "")
        return super().lookup(ns, hashes, lease_ttl_s)


class FaultyRank(SoakRank):
    """The soak's rank (L3 and directory faults) plus `crash_after`, `refuse_allocations`,
    `publish_late`, `hold_host_pages`, `fail_next_load`, `corrupt_l1_page` and
    `time_out_next_handoff`."""

    _crash_at: int | None = None
    _refusals: int = 0
    _held: list | None = None
    _fired: Counter | None = None
    _short_since = 0

    def _count(self, fault: str, n: int = 1) -> None:
        if self._fired is None:
            self._fired = Counter()
        self._fired[fault] += n

    def faults_fired(self) -> dict[str, int]:
        """The soak rank's counts plus this class's: "publish_late" (lookups answered as
        before the publication), "host_refused_tokens" (L3 hits a prefetch could not take
        for want of L2 room while pages were held), "allocation_refused", "l1_corrupted",
        "handoff_timeout". A crash is seen in the instance's `restarts`."""
        fired = {**super().faults_fired(), **(self._fired or {})}
        if isinstance(self._flaky, LateDirectory):
            fired["publish_late"] = self._flaky.hidden
        if self._held is not None:  # still held: what it refused so far
            fired["host_refused_tokens"] = fired.get("host_refused_tokens", 0) \
                + self._host_short_tokens() - self._short_since
        return fired

    def _directory(self, l3_actor: str):
        self._flaky = LateDirectory(super(SoakRank, self)._directory(l3_actor))
        return self._flaky

    def publish_late(self, lookups: int) -> None:
        """This rank's next `lookups` directory lookups happen before the pages' publication."""
        self._flaky.hide += lookups

    def hold_host_pages(self, keep_free: int) -> int:
        """Take this rank's free L2 pages but `keep_free` (no room for its prefetches);
        `release_host_pages` gives them back. Returns how many are held."""
        alloc = self.engine.cache.host_pool.allocator
        if self._held is None:
            self._short_since = self._host_short_tokens()
        self._held = (self._held or []) + (alloc.alloc(max(0, alloc.num_free - keep_free)) or [])
        return len(self._held)

    def release_host_pages(self) -> None:
        if self._held is not None:
            self._count("host_refused_tokens", self._host_short_tokens() - self._short_since)
        if self._held:
            self.engine.cache.host_pool.allocator.free(self._held)
        self._held = None

    def _host_short_tokens(self) -> int:
        """L3 hits this rank's prefetches could not take for want of L2 room so far."""
        storage = self.engine.cache.storage
        return storage.counters.unfulfilled_host_capacity_tokens if storage is not None else 0

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
                self._count("allocation_refused")
                log.warning("rank %d: refusing an allocation of %d pages (injected)",
                            self.rank, num_pages)
                return None
            return real(num_pages)

        cache.allocate = allocate  # type: ignore[method-assign]

    def fail_next_load(self) -> None:
        """This rank's next L2->L1 load fails in its first copy, leaving garbage in its L1
        pages (the controller's copy is patched in this rank's process only)."""
        import torch

        from kvtier.tiers import controller

        real = controller.copy_pages
        device = self.engine.cache.device_pool.layer_page_view().data_ptr()

        def copy(src, dst, plan, backend, layers=slice(None), non_blocking=False):
            if dst.data_ptr() != device:
                return real(src, dst, plan, backend, layers, non_blocking)
            controller.copy_pages = real  # once
            dst[:, layers].index_fill_(2, torch.tensor(list(plan.dst_pages)), 7.0)
            log.warning("rank %d: failing an L2->L1 load (injected)", self.rank)
            raise RuntimeError("injected: this rank's L2->L1 copy failed")

        controller.copy_pages = copy

    def corrupt_l1_page(self, page: int) -> None:
        """Flip bytes of one L1 page in place (a hand-off's page damaged on arrival)."""
        self.engine.cache.device_pool.kv[:, :, page] += 1.0
        self._count("l1_corrupted")

    def time_out_next_handoff(self) -> None:
        """This rank's next hand-off write times out (a slow or hung link)."""
        from kvtier.backends.transport_base import TransportTimeout

        sender = self.handoff_port.sender
        real = sender.endpoint
        count = self._count

        class _Stalling:
            def __getattr__(self, name):
                return getattr(real, name)

            def write(self, *args, **kwargs):
                sender.endpoint = real  # once
                count("handoff_timeout")
                raise TransportTimeout("the write did not finish in time (injected)")

        sender.endpoint = _Stalling()
