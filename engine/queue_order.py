"""The order of the waiting queue: arrival (FCFS), or longest cached prefix first (lpm).

lpm orders by the hit lengths the TP ranks agreed in the previous step (`Request.agreed_hit`,
the MIN over ranks of what each held in L1/L2), never by what one rank sees now: every rank
then orders its copy of the queue alike without a second collective. Equal hits keep arrival
order. Aging bounds the wait: a request that has waited `max_wait_steps` steps goes ahead of
every request that has not, in arrival order among the aged, so a request with nothing cached
is not overtaken for ever by a stream of requests that hit.
"""
from __future__ import annotations

from typing import Sequence

from kvtier.engine.request import Request
from kvtier.policies import SchedulePolicy

# 128 steps: a few seconds of decode steps on a GPU, long enough that a conversation's next
# turn (a long hit, little to compute) is not queued behind cold prompts that merely arrived
# first; 16 made lpm act like FCFS under any load (kvtier bench serve: round-2 TTFT 11 s with
# 16, 3.8 s with 128, while the coldest round-1 request waited 31 s and 44 s).
DEFAULT_MAX_WAIT_STEPS = 128


def order_waiting(waiting: Sequence[Request], policy: SchedulePolicy,
                  max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS) -> list[Request]:
    """`waiting` in the order admission scans it."""
    if policy is SchedulePolicy.FCFS:
        return sorted(waiting, key=lambda r: r.id)  # ids follow arrival
    return sorted(waiting, key=lambda r: (r.waited_steps < max_wait_steps,
                                          0 if r.waited_steps >= max_wait_steps
                                          else -r.agreed_hit, r.id))
