"""What the two halves of the vLLM connector tell each other each step.

The scheduler side (vLLM's EngineCore process) owns the L2 index and decides every copy; the
worker side (one per TP rank, in vLLM's worker processes) executes them on its own host pool
and reports back. vLLM carries a `StepPlan` to every worker inside its connector metadata and
brings each worker's `WorkerReport` back, merged over the ranks with `WorkerReport.merge`
(see docs/vllm.md). Both are plain data: vLLM pickles them between its processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class PageLoad:
    """Copy L2 slots into the vLLM blocks one request was given (slot i into block i)."""

    req_id: str
    slots: tuple[int, ...]
    blocks: tuple[int, ...]


@dataclass(frozen=True)
class PageSave:
    """Copy full vLLM blocks into L2 slots after this step's forward (block i into slot i)."""

    blocks: tuple[int, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """One step's copies: loads before the forward, saves after it. A slot a save writes is
    never one a load of the same or an earlier step still reads: the worker runs plans in
    order, loads first."""

    loads: tuple[PageLoad, ...] = ()
    saves: tuple[PageSave, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass(frozen=True)
class WorkerReport:
    """What the ranks did with one step's plan. Merged over the ranks: a slot counts as saved
    only when every rank saved its part (the MIN rule), a block failed when any rank failed
    it; `ranks` says how many reports were merged. Slots throughout: the worker keeps the
    blocks a failed load left for vLLM to recompute."""

    ranks: int = 1
    saved: frozenset[int] = field(default_factory=frozenset)
    failed_saves: frozenset[int] = field(default_factory=frozenset)
    failed_loads: frozenset[int] = field(default_factory=frozenset)  # L2 slots

    def merge(self, other: "WorkerReport") -> "WorkerReport":
        return WorkerReport(ranks=self.ranks + other.ranks,
                            saved=self.saved & other.saved,
                            failed_saves=self.failed_saves | other.failed_saves
                            | (self.saved ^ other.saved),
                            failed_loads=self.failed_loads | other.failed_loads)
