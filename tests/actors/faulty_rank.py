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

from kvtier.actors.rank_actor import RankCache

log = logging.getLogger(__name__)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class FaultyRankCache(RankCache):
    """RankCache plus `crash_after` and `refuse_allocations`."""

    _crash_at: int | None = None
    _refusals: int = 0

    def crash_after(self, steps: int) -> None:
        """Kill this rank's process at the start of its `steps`-th next step (it dies with
        requests in flight while its peers wait in a collective)."""
        self._crash_at = self.steps + steps

    def step(self) -> bytes:
        if self._crash_at is not None and self.steps >= self._crash_at:
            log.error("rank %d: crashing at step %d (injected)", self.rank, self.steps)
            os._exit(1)
        return super().step()

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
