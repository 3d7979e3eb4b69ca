"""Seeded requests on vLLM's CPU build, prefilled in one step.

vLLM 0.32's CPU model runner rewinds a seeded request's random generator whenever a step
drops that request's sample, which it does for each step of a prompt prefilled in pieces (a
partial prefill); a CPU generator cannot be rewound ("CPU Generator does not use offset"),
the worker raises and the engine dies. A client's seed and a long prompt, or a busy step,
took an instance down (`kvtier bench chaos --engine vllm` found it).

`SeedGate` keeps vLLM from ever splitting a seeded, sampled request's prefill: such a request
goes to vLLM only when no other request is being prefilled and its whole prompt fits the
step's token budget beside the running decodes, and nothing else goes to vLLM until its first
token came (vLLM's hit-first admission would otherwise put a cache hit before it). Held
requests keep their order. A seeded request whose prompt cannot fit one step at all is
sampled without its seed (said once): OpenAI's API makes a seed best effort. Greedy requests
and other devices pass straight through.
"""
from __future__ import annotations

import dataclasses
import logging
from collections import deque
from typing import Collection, NamedTuple

from kvtier.engine.request import Resume
from kvtier.engine.sampling import SamplingParams

log = logging.getLogger(__name__)


class Pending(NamedTuple):
    """A request on its way to vLLM (VllmInstance.add_request's arguments)."""

    request_id: int
    tokens: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str
    resume: Resume | None
    arrived: float = 0.0  # monotonic: when the instance took it
    label: str = ""  # its id as its client knows it (vllm_request_id)

    @property
    def prompt_len(self) -> int:
        return len(self.tokens) + (0 if self.resume is None else len(self.resume.tokens))


class SeedGate:
    """Requests to vLLM in order, a seeded one only when vLLM can prefill it in one step of
    `budget_tokens` (vLLM's max_num_batched_tokens). `active` False: everything passes."""

    def __init__(self, budget_tokens: int, active: bool) -> None:
        self.budget_tokens, self.active = budget_tokens, active
        self._held: deque[Pending] = deque()
        self._seeded: int | None = None  # the seeded request let through, until it steps
        self._said = False

    def __len__(self) -> int:
        return len(self._held)

    def admit(self, pending: Pending) -> Pending | None:
        """`pending` (its seed dropped when no step could hold its prompt) to add to vLLM
        now, or None: held until `release` lets it go."""
        if self._gated(pending) and pending.prompt_len >= self.budget_tokens:
            pending = self._unseeded(pending)
        if self._held or self._seeded is not None or self._gated(pending):
            self._held.append(pending)
            return None
        return pending

    def release(self, prefilling: Collection[int], running: int) -> list[Pending]:
        """The held requests that go to vLLM now, in order. `prefilling`: the ids of requests
        added that have no token yet; `running`: requests added and not finished."""
        if self._seeded is not None and self._seeded in prefilling:
            return []
        self._seeded = None
        out: list[Pending] = []
        while self._held:
            head = self._held[0]
            if self._gated(head):
                if out or prefilling or head.prompt_len + running > self.budget_tokens:
                    break  # the next step would not prefill it whole: wait
                self._seeded = head.request_id
                out.append(self._held.popleft())
                break
            out.append(self._held.popleft())
        return out

    def drop(self, request_id: int) -> bool:
        """Forget a held request (aborted); whether it was held."""
        for pending in self._held:
            if pending.request_id == request_id:
                self._held.remove(pending)
                return True
        return False

    def _gated(self, pending: Pending) -> bool:
        s = pending.sampling
        return self.active and s.seed is not None and s.temperature > 0

    def _unseeded(self, pending: Pending) -> Pending:
        if not self._said:
            self._said = True
            log.warning("a seeded request's prompt (%d tokens) does not fit one step of %d: "
                        "vLLM's CPU build cannot prefill it in pieces with its seed, so it "
                        "is sampled without (said once)", pending.prompt_len,
                        self.budget_tokens)
        return pending._replace(sampling=dataclasses.replace(pending.sampling, seed=None))


def seeds_need_a_gate() -> bool:
    """Whether this process's vLLM platform is the CPU one (module docstring)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())

