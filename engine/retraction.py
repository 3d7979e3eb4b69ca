"""Retraction: a decoding request pushed out of L1 keeps its KV in L2 and resumes later.

When L1 is full and a decoding request must make room, the scheduler retracts it where it
can instead of preempting it: its whole KV (every page of prompt and output so far, the
partial last page included) is copied into L2 pages it holds itself (`cache.swap_out`), its
L1 pages are released as on any release, and it keeps its output and sampler. Later it is
restored: fresh L1 pages, an L2->L1 copy (`cache.swap_in`), and decoding goes on where it
stopped. No token is computed twice, and the copies are byte-exact, so the answer is the one
a run without retraction gives (bit-identical in deterministic mode). Where L2 has no room,
a copy fails, there is no L2 or the model is hybrid (`cache.can_swap`), the request is
preempted as before: it restarts from its prompt (a fallback, counted).

The release hands the request's whole pages to the tree like any release (deterministic mode:
its prompt's only), so they stay matchable while L1 keeps them; with an L3 attached the
write policy backs them up to L2 and L3 as it does every stored run, nothing more. The
request's own L2 copy is outside the tree: never matched by others, never sent to L3, given
back when the request resumes, finishes or is aborted.

TP ranks (reserve -> agree -> commit in the step's one agreement round, kvtier.engine.agreement):
- Retract. The victim is chosen from replicated state after the round that found a decode
  page short, and every rank retracts it (copy, then release) whether or not its own copy
  worked; the next round says whether every rank holds one (`retract_failed`, MAX). If one
  does not, every rank recomputes the request. At TP=1 that is known at once.
- Restore. Before the round each rank reserves L1 for the first retracted request (running
  order) and loads its KV there (`restore_ok`, MIN); it resumes where every rank did, else
  every rank gives its reservation back and tries again next step. While a request is
  retracted nothing new is admitted (vLLM's rule for swapped requests): new prompts would
  take the L1 it waits for. A restore refused while no other request holds L1 (once at
  TP=1, twice in a row across ranks, where a refusal may be one rank's transient) falls back
  to recompute, and admission decides from there (NO_MEMORY at worst).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from typing import Callable, NamedTuple, Sequence

from kvtier.engine.agreement import RetractionVote
from kvtier.engine.request import Request, RequestState, pages_for
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)


@dataclass
class RetractionCounters:
    """Monotonic counts of one scheduler's retractions."""

    retracted_requests: int = 0  # retractions every rank kept an L2 copy of
    restored_requests: int = 0   # retracted requests back in L1, decoding on
    retract_fallbacks: int = 0   # decoding requests that had to leave L1 and were recomputed
    swapped_out_pages: int = 0   # L2 pages those retractions took (this rank's)

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(eq=False)
class _Holding:
    """One retracted request's L2 copy of its KV on this rank."""

    req: Request
    host_pages: list[int] | None  # one per KV page; None: this rank could not keep a copy
    confirmed: bool = False       # every rank holds a copy (TP=1: at once)
    idle_refusals: int = 0        # restores in a row refused while no other request held L1


class _Reservation(NamedTuple):
    """This rank's hold on the restore candidate, before the ranks agree."""

    holding: _Holding
    pages: list[int] | None  # L1 pages with its KV loaded back; None: no room or a failed load


class Settled(NamedTuple):
    """What the agreed vote decided, for the scheduler (which owns the queues) to act on."""

    fallbacks: tuple[Request, ...]  # still RETRACTED: to preempt (they restart from the prompt)
    restored: Request | None        # DECODING again; it decodes from the next step on


class Retraction:
    """The retracted requests' L2 holdings on one rank, and their restore (module docstring).
    The requests themselves stay in the scheduler's running queue, in state RETRACTED."""

    def __init__(self, cache: HierarchicalCache, page_size: int) -> None:
        self.cache, self.page_size = cache, page_size
        self.enabled = cache.can_swap  # config only, so the same on every rank
        self.counters = RetractionCounters()
        self._held: dict[int, _Holding] = {}  # request id -> its copy, in retraction order
        self._reserved: _Reservation | None = None  # between `vote` and `settle`

    @property
    def holding(self) -> bool:
        """Some request is retracted (replicated state: every rank agrees)."""
        return bool(self._held)

    def retract(self, req: Request, release: Callable[[Request], None], agreed: bool) -> bool:
        """Push decoding `req` out of L1 keeping its KV: copy it to L2, `release(req)` (the
        scheduler's release of its L1 pages), mark it RETRACTED. False, with nothing done,
        when it cannot be retracted: the caller preempts it. `agreed`: TP ranks, where every
        rank retracts it and the next round tells whether every rank kept a copy."""
        if req.state is not RequestState.DECODING:
            return False  # a prefill has no output to keep: it restarts, as before
        kv_pages = req.pages[:pages_for(req.kv_len, self.page_size)]
        host_pages = self.cache.swap_out(kv_pages) if self.enabled else None
        if host_pages is None and not (agreed and self.enabled):
            self.counters.retract_fallbacks += 1
            log.info("request %d cannot be retracted (%s); it is recomputed", req.id,
                     "no L2 room" if self.enabled else "retraction is off for this cache")
            return False
        release(req)  # after the copy: the release may free the pages it read
        req.retract()
        holding = self._held[req.id] = _Holding(req, host_pages)
        if not agreed:
            self._confirm(holding)
        return True

    def vote(self, running: Sequence[Request]) -> RetractionVote:
        """This rank's say in the step's round: does it lack a copy of a request retracted
        last step, and did it reserve L1 for the first retracted request and load its KV?"""
        failed = any(h.host_pages is None for h in self._held.values() if not h.confirmed)
        candidate = next((self._held[r.id] for r in running
                          if r.id in self._held and self._held[r.id].confirmed), None)
        self._reserved = None if candidate is None else _Reservation(candidate,
                                                                     self._load(candidate))
        ready = self._reserved is not None and self._reserved.pages is not None
        return RetractionVote(int(failed), int(ready))

    def _load(self, holding: _Holding) -> list[int] | None:
        """L1 pages for the request's KV and its next token, with the KV copied back in."""
        assert holding.host_pages is not None, "a confirmed retraction holds a copy"
        req = holding.req
        pages = self.cache.allocate(pages_for(req.kv_len + 1, self.page_size))
        if pages is None:
            return None
        if not self.cache.swap_in(holding.host_pages, pages[:len(holding.host_pages)]):
            self.cache.release_pages(pages)
            return None
        return pages

    def settle(self, vote: RetractionVote, busy: bool, agreed: bool) -> Settled:
        """Act on the agreed `vote`: keep or give up last step's retractions, resume the
        reserved candidate or give its pages back. `busy`: another request holds L1, so a
        refused restore waits for it to leave."""
        fallbacks = []
        for holding in self._held.values():
            if not holding.confirmed:
                if vote.retract_failed:
                    fallbacks.append(holding.req)
                else:
                    self._confirm(holding)
        restored = None
        reserved, self._reserved = self._reserved, None
        if reserved is not None and vote.restore_ok:
            assert reserved.pages is not None, "every rank reserved, this one included"
            restored = self._resume(reserved.holding, reserved.pages)
        elif reserved is not None:
            if reserved.pages is not None:
                self.cache.release_pages(reserved.pages)
            holding = reserved.holding
            holding.idle_refusals = 0 if busy else holding.idle_refusals + 1
            if holding.idle_refusals >= (2 if agreed else 1):
                log.warning("request %d: L1 cannot take its %d KV tokens back with nothing "
                            "else running; it is recomputed", holding.req.id,
                            holding.req.kv_len)
                fallbacks.append(holding.req)
        self.counters.retract_fallbacks += len(fallbacks)
        return Settled(tuple(fallbacks), restored)

    def _confirm(self, holding: _Holding) -> None:
        assert holding.host_pages is not None
        holding.confirmed = True
        self.counters.retracted_requests += 1
        self.counters.swapped_out_pages += len(holding.host_pages)
        log.info("request %d retracted: %d KV tokens kept in L2 after %d output tokens",
                 holding.req.id, holding.req.kv_len, len(holding.req.output))

    def _resume(self, holding: _Holding, pages: list[int]) -> Request:
        req = holding.req
        self.drop(req)  # its KV is back in L1
        req.resume(self.cache.bare_lookup(len(req.prompt), req.cache_salt), pages)
        self.counters.restored_requests += 1
        log.info("request %d restored: %d KV tokens back in L1", req.id, req.kv_len)
        return req

    def drop(self, req: Request) -> None:
        """`req` is no longer retracted (restored, recomputed, finished or aborted): its L2
        copy goes back."""
        holding = self._held.pop(req.id, None)
        if holding is not None and holding.host_pages is not None:
            self.cache.free_swapped(holding.host_pages)
