"""The admission window: which waiting requests take a step's agreement slots at TP > 1.

The agreement (kvtier.engine.agreement) reduces a tensor of a fixed shape: AGREEMENT_SLOTS
slots, one per waiting request it decides about (whether every rank reserved it, the prefix
they all hold, whether their L3 prefetches for it may end, its agreed hit, by which lpm orders
the queue). A longer queue is seen through a window. A fixed one, the first slots of the queue,
starves the rest: while the requests in it wait for their prefetches, a request behind them is
never admitted however much L1 is free, its finished prefetch is never ended (its L2 pages sit
outside the tree) and lpm orders it by a hit nobody refreshes.

So the window has two parts. The head: the first `head` requests in queue order, the ones
admission takes first (the policy's choice). The other slots rotate over the requests behind
the head: they go to those that took a slot least recently (ties in queue order; a request
that never took one counts as if it took one the step before it arrived), so each of them takes
one at least every ceil(behind / rotating) steps, and a newcomer never pushes an older one back. Admission
scans the window in queue order, so a rotating request is admitted only where the scan reaches
it: every head request before it was admitted or waits for its prefetch (a request refused for
want of room or budget still stops the scan; nobody overtakes it).

Every rank picks the same window without a word: the queue is replicated state, and so is the
step each request last took a slot in (each rank's past windows were the same).
"""
from __future__ import annotations

from typing import Sequence

from kvtier.engine.agreement import AGREEMENT_SLOTS
from kvtier.engine.request import Request
from kvtier.errors import ConfigError

HEAD_SLOTS = AGREEMENT_SLOTS // 2  # the rest rotate


class AdmissionWindow:
    """`select` once per step (every rank in the same step): the requests of the waiting queue
    that take the agreement's `slots`."""

    def __init__(self, slots: int = AGREEMENT_SLOTS, head: int = HEAD_SLOTS) -> None:
        if not 0 < head < slots:
            raise ConfigError(f"an admission window of {slots} slots needs a head of 1 to "
                              f"{slots - 1} slots (the rest rotate), got {head}")
        self.slots, self.head = slots, head
        self.step = 0
        self._last: dict[int, int] = {}  # request id -> step it last took a slot (or arrived)

    def select(self, waiting: Sequence[Request]) -> list[Request]:
        """The requests that take this step's slots, in queue order: all of `waiting` when it
        fits, else its head and the rotating slots' requests."""
        # A newcomer counts as if it took a slot in the step before: behind those that have
        # waited longer, ahead of those that take one from now on. Requests no longer waiting
        # are forgotten; one that comes back (preempted) is a newcomer.
        last = {r.id: self._last.get(r.id, self.step) for r in waiting}
        self.step += 1
        if len(waiting) <= self.slots:
            chosen = list(waiting)
        else:
            behind = sorted(range(self.head, len(waiting)),
                            key=lambda i: (last[waiting[i].id], i))[:self.slots - self.head]
            chosen = list(waiting[:self.head]) + [waiting[i] for i in sorted(behind)]
        for req in chosen:
            last[req.id] = self.step
        self._last = last
        return chosen
