"""What the two halves of the vLLM connector tell each other each step.

The scheduler side (vLLM's EngineCore process) owns the L2 index and decides every copy; the
worker side (one per TP rank, in vLLM's worker processes) executes them on its own host pool
and reports back. vLLM carries a `StepPlan` to every worker inside its connector metadata and
brings each worker's `WorkerReport` back, merged over the ranks with `WorkerReport.merge`
(see docs/vllm.md). Both are plain data: vLLM pickles them between its processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.messages import PeerContact


class Ticket(NamedTuple):
    """One fetch of one slot: the slot and the generation of the fetch that reserved it. A
    rank's report on a fetch names its ticket, so a report on an earlier fetch of the same
    slot is told apart and changes nothing (kvtier.connector.l2_index)."""

    slot: int
    gen: int


@dataclass(frozen=True)
class PageLoad:
    """Copy L2 slots into the vLLM blocks one request was given (slot i into block i)."""

    req_id: str
    slots: tuple[int, ...]
    blocks: tuple[int, ...]
    from_l3: int = 0  # how many of the slots were read from L3 for it (counted by tier)
    from_peer: int = 0  # how many were read from a peer's L2 for it


@dataclass(frozen=True)
class PageSave:
    """Copy full vLLM blocks into L2 slots after this step's forward (block i into slot i,
    which then holds the page keyed key i)."""

    blocks: tuple[int, ...]
    slots: tuple[int, ...]
    keys: tuple[str, ...] = ()


@dataclass(frozen=True)
class PageFetch:
    """Read pages into L2 slots (key i into slot i), in the background: from L3, or with
    `peer` from that peer's L2 (`first_page`: the prompt page key 0 is, for the logs)."""

    keys: tuple[str, ...]
    slots: tuple[int, ...]
    gen: int  # the generation of the fetch (one for all its slots)
    peer: PeerContact | None = None
    first_page: int = 0

    def tickets(self) -> tuple[Ticket, ...]:
        return tuple(Ticket(slot, self.gen) for slot in self.slots)


@dataclass(frozen=True)
class PageStore:
    """Write L2 slots' objects (this rank's KV heads) to L3 under page key i, in the
    background: planned once every rank reported the slots saved, so no rank ever writes a
    slot another rank failed to fill (the scheduler side may have reused it)."""

    keys: tuple[str, ...]
    slots: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    """One step's copies: loads before the forward, saves after it. A slot a save writes is
    never one a load of the same or an earlier step still reads: the worker runs plans in
    order, loads first."""

    loads: tuple[PageLoad, ...] = ()
    saves: tuple[PageSave, ...] = ()
    fetches: tuple[PageFetch, ...] = ()
    stores: tuple[PageStore, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.loads or self.saves or self.fetches or self.stores)


@dataclass(frozen=True)
class WorkerReport:
    """What the ranks did with one step's plan. Merged over the ranks: a slot counts as saved
    only when every rank saved its part (the MIN rule), a block failed when any rank failed
    it; `ranks` says how many reports were merged. Slots throughout: the worker keeps the
    blocks a failed load left for vLLM to recompute.

    Fetches end in the background, each rank's in a step of its own, so each rank reports
    each of its tickets once: read (`fetched`), not read (`failed_fetches`), or not read while
    its storage or peer call may still write the slot (`held_fetches`, then `released` once
    that call returned). The scheduler side counts one report per rank and frees a failed
    slot only when every rank reported and no call holds it."""

    ranks: int = 1
    saved: frozenset[int] = field(default_factory=frozenset)
    failed_saves: frozenset[int] = field(default_factory=frozenset)
    failed_loads: frozenset[int] = field(default_factory=frozenset)  # L2 slots
    # L3 and peers, finished in the background since the last report, so ranks report one
    # slot in different steps: one entry per rank that finished it (the scheduler counts them)
    stored: tuple[int, ...] = ()  # slots whose objects the rank wrote, or gave up on
    failed_stores: frozenset[int] = field(default_factory=frozenset)  # of those: gave up on
    fetched: tuple[Ticket, ...] = ()  # read from L3 or a peer: one entry per rank
    failed_fetches: tuple[Ticket, ...] = ()  # not read; nothing writes the slot any more
    held_fetches: tuple[Ticket, ...] = ()  # not read; a call may still write the slot
    released: tuple[Ticket, ...] = ()  # of held ones: the call returned

    def merge(self, other: "WorkerReport") -> "WorkerReport":
        return WorkerReport(ranks=self.ranks + other.ranks,
                            saved=self.saved & other.saved,
                            failed_saves=self.failed_saves | other.failed_saves
                            | (self.saved ^ other.saved),
                            failed_loads=self.failed_loads | other.failed_loads,
                            stored=self.stored + other.stored,
                            failed_stores=self.failed_stores | other.failed_stores,
                            fetched=self.fetched + other.fetched,
                            failed_fetches=self.failed_fetches + other.failed_fetches,
                            held_fetches=self.held_fetches + other.held_fetches,
                            released=self.released + other.released)
