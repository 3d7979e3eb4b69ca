"""Hit-first admission for a vLLM engine with KvtierConnector (docs/vllm.md), free of vLLM:
which waiting request goes next, and which running prefills make room for it.

vLLM admits first come, first served, and a waiting request never preempts a running one.
Under a multi-turn load that makes a follow-up whose history L2 holds (a copy of ~0.3 s here)
wait behind the cold first turns admitted just before it (seconds of prefill each). kvtier's
own engine admits the longest cached prefix first; this is the same rule for vLLM's
scheduler (kvtier.connector.vllm_scheduler), with one more step that vLLM's preemption makes
cheap: a cold prefill still computing its prompt may be preempted for a hit, when every
full page it computed so far is already in L2 (the connector saved it after the step that
filled it): readmitted, it loads those pages instead of computing them again.

The rules, each bounded:
- a hit is a waiting request whose prefix cache and L2 hold at least `HIT_SHARE` of its
  prompt (and one page); the one with the most cached tokens goes first;
- it preempts only what it needs (KV blocks, then token budget for its uncached tokens),
  only running requests still in their prompt, with more prompt left to compute than the
  hit has, whose computed pages L2 holds, and never one preempted before (no request is
  pushed back twice: no starvation);
- without a hit nothing changes: vLLM's own order; once a request has waited
  `max_wait_steps` steps (kvtier's engine's aging, engine/queue_order) the oldest waiting
  request goes first, ahead of a hit put there in an earlier step, so a stream of hits
  cannot hold a cold prompt back for ever;
- a block counts once: a block a victim alone holds that the hit's cached prefix also uses
  (vLLM's prefix cache shares it) is not freed for the hit by preempting the victim, since
  the hit takes it back;
- a victim's pages in L2 are pinned there until it is admitted again or leaves
  (kvtier.connector.vllm_scheduler), so readmitted it loads them rather than computing them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

from kvtier.engine.queue_order import DEFAULT_MAX_WAIT_STEPS

HIT_SHARE = 0.5  # a waiting request is a hit when this share of its prompt is cached


@dataclass(frozen=True)
class WaitingRequest:
    """A request waiting for its first admission (nothing computed)."""

    req_id: str
    tokens: int  # its tokens (prompt, and answer tokens of a resumed request)
    cached: int  # leading tokens vLLM's prefix cache and L2 hold now
    blocks_needed: int  # KV blocks admitting it takes from the free pool
    shared: frozenset[int] = frozenset()  # its cached blocks running requests hold (ids)


@dataclass(frozen=True)
class RunningRequest:
    """A running request, in vLLM's running order."""

    req_id: str
    prompt: int  # prompt tokens
    computed: int  # tokens computed so far
    saved: int  # leading tokens whose pages L2 holds
    freeable: frozenset[int]  # ids of the KV blocks preempting it returns to the free pool
    preempted_before: bool
    can_free: bool = True  # vLLM may free its blocks now

    @property
    def prefilling(self) -> bool:
        return self.computed < self.prompt

    def next_tokens(self, budget: int) -> int:
        """Tokens vLLM schedules for it next step: a prompt chunk, or one decode token."""
        return min(self.prompt - self.computed, budget) if self.prefilling else 1

    def frees_for(self, hit: WaitingRequest) -> int:
        """Blocks preempting it frees for `hit`: none the hit's cached prefix takes back."""
        return len(self.freeable - hit.shared)


class Admission(NamedTuple):
    """What to do before vLLM schedules: preempt `preempt` (running ids), then put `first`
    (a waiting id, or None: keep vLLM's order) at the head of the waiting queue."""

    first: str | None
    preempt: tuple[str, ...]


KEEP = Admission(None, ())


def is_hit(request: WaitingRequest, block_size: int) -> bool:
    return request.cached >= max(block_size, HIT_SHARE * request.tokens)


def admit(waiting: Sequence[WaitingRequest], running: Sequence[RunningRequest],
          free_blocks: int, token_budget: int, block_size: int, oldest_wait_steps: int = 0,
          max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS, oldest: str | None = None) -> Admission:
    """The admission for this step (module docstring); `oldest_wait_steps`: the steps the
    longest-waiting request (`oldest`, of any kind) has waited."""
    if oldest_wait_steps >= max_wait_steps:
        return Admission(oldest, ())  # aging: the oldest first, whatever was put first before
    hits = [w for w in waiting if is_hit(w, block_size)]
    if not hits:
        return KEEP
    first = max(hits, key=lambda w: w.cached)  # the earliest of equals: max keeps the first
    own_tokens = max(1, first.tokens - first.cached)
    left = token_budget - sum(r.next_tokens(token_budget) for r in running)
    victims = sorted((r for r in running if _may_preempt(r, own_tokens, block_size)),
                     key=lambda r: r.computed)  # the least work lost first
    chosen: list[str] = []
    for victim in victims:
        if free_blocks >= first.blocks_needed and left >= own_tokens:
            break
        chosen.append(victim.req_id)
        free_blocks += victim.frees_for(first)
        left += victim.next_tokens(token_budget)
    if free_blocks < first.blocks_needed:
        chosen = []  # it would not fit anyway: preempt nothing, keep it first in line
    return Admission(first.req_id, tuple(chosen))


def _may_preempt(r: RunningRequest, own_tokens: int, block_size: int) -> bool:
    """A cold prefill, longer than the hit's own work, that loses nothing to L2."""
    computed_pages = r.computed // block_size
    return (r.prefilling and r.can_free and not r.preempted_before
            and r.prompt - r.computed > own_tokens
            and r.saved >= computed_pages * block_size)


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks `tokens` tokens and the next one take."""
    return math.ceil((tokens + 1) / block_size)
