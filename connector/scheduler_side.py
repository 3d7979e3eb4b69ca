"""The scheduler half of the vLLM connector, free of vLLM: it answers how many of a
request's tokens L2 can supply, and plans each step's copies (docs/vllm.md).

vLLM's adapter (kvtier.connector.vllm_connector) calls it from the EngineCore process:
`add` when a request arrives, `match` when vLLM asks for external tokens, `allocated` once
vLLM gave the request its blocks, `plan` once per step, `settle` with the ranks' merged
report, `finish` when the request leaves. Every full block a request computes (prompt or
generated) is saved once, after the step that filled it, unless L2 already holds its page.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from kvtier.connector.l2_index import L2Index
from kvtier.connector.plan import PageLoad, PageSave, StepPlan, WorkerReport
from kvtier.keys import KeyNamespace, page_hashes


@dataclass(frozen=True)
class ScheduledRequest:
    """One request in a step, as the plan needs it."""

    req_id: str
    tokens: Sequence[int]  # every token the request has (prompt, then outputs)
    blocks: Sequence[int]  # its vLLM block ids, in order
    computed_after: int  # tokens whose KV is in its blocks once this step ran


@dataclass(slots=True)
class ConnectorCounts:
    """What the connector did so far (tokens and pages)."""

    requests: int = 0
    l2_hit_tokens: int = 0
    saved_pages: int = 0
    loaded_pages: int = 0
    failed_saves: int = 0
    failed_loads: int = 0


@dataclass
class _Request:
    salt: str
    keys: list[str] = field(default_factory=list)  # chain digests of its full pages so far
    planned_pages: int = 0  # pages before this one were saved, or found in L2
    match: tuple[int, list[int]] | None = None  # (first page, L2 slots) of the last match
    load: PageLoad | None = None  # waiting for the next plan


class SchedulerSide:
    """L2 hits and copy plans for one vLLM engine of `tp_size` ranks."""

    def __init__(self, namespace: KeyNamespace, block_size: int, num_slots: int,
                 tp_size: int = 1) -> None:
        self.namespace = namespace
        self.block_size = block_size
        self.tp_size = tp_size
        self.index = L2Index(num_slots)
        self._requests: dict[str, _Request] = {}
        self._counts = ConnectorCounts()

    @property
    def counts(self) -> ConnectorCounts:
        return dataclasses.replace(self._counts)

    def add(self, req_id: str, salt: str = "") -> None:
        self._requests[req_id] = _Request(salt)
        self._counts.requests += 1

    def match(self, req_id: str, tokens: Sequence[int], local_tokens: int) -> int:
        """Tokens past `local_tokens` (vLLM's own hit, block-aligned) that L2 holds for every
        rank; at least one token is left for vLLM to compute."""
        req = self._requests[req_id]
        last_page = (len(tokens) - 1) // self.block_size
        first = local_tokens // self.block_size
        if last_page <= first:
            req.match = None
            return 0
        slots = self.index.held_run(self._keys(req, tokens, last_page)[first:last_page])
        req.match = (first, slots)
        return len(slots) * self.block_size

    def allocated(self, req_id: str, blocks: Sequence[int], external_tokens: int) -> None:
        """vLLM gave the request `blocks` and will take `external_tokens` from the connector:
        the next plan loads them."""
        req = self._requests[req_id]
        pages = external_tokens // self.block_size
        if pages == 0 or req.match is None:
            return
        first, slots = req.match
        if pages > len(slots):
            raise ValueError(f"vLLM asked request {req_id} for {pages} pages from the "
                             f"connector, which matched {len(slots)}")
        self.index.touch(slots[:pages])
        req.load = PageLoad(req_id, tuple(slots[:pages]), tuple(blocks[first:first + pages]))
        self._counts.l2_hit_tokens += external_tokens
        self._counts.loaded_pages += pages

    def plan(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        """This step's copies: the loads `allocated` asked for, then a save of every block
        that becomes full in this step and whose page L2 does not have."""
        loads = []
        for req in self._requests.values():
            if req.load is not None:
                loads.append(req.load)
                req.load = None
        saves = [save for s in scheduled if (save := self._saves(s)) is not None]
        return StepPlan(tuple(loads), tuple(saves))

    def settle(self, report: WorkerReport) -> None:
        """The ranks' merged report on the last plan."""
        saved = report.saved if report.ranks >= self.tp_size else frozenset()
        failed = report.failed_saves | (report.saved - saved)
        self.index.settle(saved, failed)
        dropped = self.index.drop_slots(report.failed_loads)
        self._counts.failed_saves += len(failed)
        self._counts.failed_loads += dropped

    def finish(self, req_id: str) -> None:
        self._requests.pop(req_id, None)

    def _saves(self, step: ScheduledRequest) -> PageSave | None:
        req = self._requests.get(step.req_id)
        if req is None:
            return None
        full = min(step.computed_after, len(step.tokens)) // self.block_size
        full = min(full, len(step.blocks))
        if full <= req.planned_pages:
            return None
        keys = self._keys(req, step.tokens, full)
        new = [p for p in range(req.planned_pages, full) if keys[p] not in self.index]
        req.planned_pages = full
        slots = self.index.reserve([keys[p] for p in new])
        if not slots:
            return None
        self._counts.saved_pages += len(slots)
        return PageSave(tuple(step.blocks[p] for p in new[:len(slots)]), tuple(slots))

    def _keys(self, req: _Request, tokens: Sequence[int], pages: int) -> list[str]:
        """The request's first `pages` page keys, extending its chain as tokens arrive."""
        have = len(req.keys)
        if pages > have:
            bs = self.block_size
            prior = req.keys[-1] if req.keys else None
            seed = None if prior else self.namespace.chain_seed(req.salt)
            req.keys += page_hashes(tokens[have * bs:pages * bs], bs, seed=seed, prior=prior)
        return req.keys
