"""Admission: which waiting requests start this step, under the token budget and L1's room.

The scan goes in arrival order: lookup (match + load-back within the memory quota), usable
prefix, pages for the rest. Load-back and prefill tokens both count against the step's
`Budget`; the scan stops when the budget or L1 runs out, and the request stays waiting
holding nothing (FCFS: nobody overtakes it).

TP ranks (one scheduler each, same request stream) differ only in their caches, so admission
is reserve -> agree -> commit: each rank looks up and allocates for the step's candidates,
then `agree` (one collective, kvtier.engine.agreement) gives every rank the MIN usable prefix
and whether every rank reserved; a candidate any rank could not reserve is rolled back on all.
A rank reserves pages for the whole prompt when it has a hit (freeing the surplus on commit),
so any agreed prefix shorter than its own can be recomputed into fresh pages; if only its
own-hit share fits, it says so (`need`) and the slot commits only if the MIN is that long.
L3 prefetch readiness is agreed in the same round and acted on at the next step's start.
Every waiting request in the step's window (kvtier.engine.admission_window: the queue's head and
slots that rotate over the rest, so that every request takes one in turn) takes the same slot
on every rank, whatever its local L3 result: a request some rank still fetches for is not
admitted this step (on any rank) but does not stop the scan, and a rank that reserved it rolls
back.
With `agree=None` (TP=1) none of this changes what a single scheduler does.

`Admission` only decides and commits reservations into requests; moving them between the
scheduler's queues, finishing refused ones and aborting on `terminate` stay with the
`Scheduler`, which owns the queues.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import NamedTuple, Sequence

from kvtier.engine.admission_window import AdmissionWindow
from kvtier.engine.agreement import (NO_TICKET, SLOT_FAILED, SLOT_RESERVED,
                                     SLOT_SKIPPED, Agree, AgreementPayload, RetractionVote,
                                     ids_digest, local_agree)
from kvtier.engine.handoff_intake import HandoffIntake
from kvtier.engine.request import CachedTokens, Request, pages_for
from kvtier.engine.runner import ModelRunner, chunk_bounds
from kvtier.tiers.cache_types import CacheLookup, RequestLengths
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Budget:
    """One step's token budget: what is `left`, and what load-back and prefill took of it."""

    left: int
    chunk: int  # the prefill grid
    whole_chunks: bool = False  # deterministic mode: spent in whole grid chunks only
    loaded: int = 0
    prefill: int = 0

    @property
    def used(self) -> int:
        return self.loaded + self.prefill

    def charge_load(self, tokens: int) -> None:
        self.loaded += tokens
        self.left -= tokens

    def plan_chunks(self, req: Request, start: int | None = None) -> int:
        """How far `req` prefills this step: as many tokens as the budget has left (whole
        grid chunks while it lasts, in deterministic mode)."""
        stop = req.pos if start is None else start
        if not self.whole_chunks:
            take = max(0, min(len(req.prompt) - stop, self.left))
            self.left -= take
            self.prefill += take
            return stop + take
        for lo, hi in chunk_bounds(stop, len(req.prompt), self.chunk):
            if hi - lo > self.left:
                break
            self.left -= hi - lo
            self.prefill += hi - lo
            stop = hi
        return stop


class Admitted(NamedTuple):
    """A request committed this step (now PREFILLING) and how far it prefills in it."""

    req: Request
    stop: int


class AdmissionResult(NamedTuple):
    """What one step's admission decided, for the scheduler to act on."""

    admitted: tuple[Admitted, ...]  # in commit order; still in the waiting queue
    refused: tuple[Request, ...]    # to finish with NO_MEMORY; still in the waiting queue
    ready: dict[int, int]           # request id -> prompt page up to which its finished L3
    #                                 prefetch is taken (the MIN every rank landed)
    decode_short: bool              # some rank lacks a decoding sequence's page
    terminate: bool                 # some rank asked to stop: abort every request
    reached: frozenset[int] = frozenset()  # ids of the requests this rank's scan reached
    vote: RetractionVote = RetractionVote()  # the ranks' agreed say on retraction


class _Reservation(NamedTuple):
    """One rank's hold on an admission candidate, before the ranks agree."""

    req: Request
    lookup: CacheLookup
    fresh: list[int] | None  # None: L1 could not make room
    usable: int              # this rank's own usable prefix
    need: int                # the shortest agreed prefix `fresh` covers
    released: bool = False   # the lookup was already given back (TP=1 NO_MEMORY path)

    @property
    def status(self) -> int:
        return SLOT_FAILED if self.fresh is None else SLOT_RESERVED


class Admission:
    """Reserve -> agree -> commit over the waiting requests of one HierarchicalCache."""

    def __init__(self, cache: HierarchicalCache, runner: ModelRunner,
                 max_load_pages: int | None = None, agree: Agree | None = None,
                 share_hits: bool = False) -> None:
        self.cache, self.runner = cache, runner
        self.share_hits = share_hits  # agree on every slot's L1/L2 hit (lpm orders by it)
        self.page_size, self.chunk = runner.page_size, runner.chunk_tokens
        self.max_load_pages = max_load_pages  # memory quota for one request's load-back
        self.agree = agree  # None: one rank, nothing to agree on (TP=1)
        self.window = AdmissionWindow()  # which waiting requests take the agreement's slots
        self.rolled_back = 0  # reservations undone because some rank could not make them
        self.handoffs = HandoffIntake(cache)  # decode side: adopting received prompt KV
        self._strikes: dict[int, int] = {}  # request id -> steps refused with nothing running

    def admit(self, waiting: Sequence[Request], busy: bool, budget: Budget, *,
              terminate: bool = False, decode_short: bool = False,
              vote: RetractionVote = RetractionVote()) -> AdmissionResult:
        """Reserve on this rank, agree across ranks (once per step), commit what all reserved.
        `busy`: something is running, or L1 is held for hand-offs, so a refusal is L1 being
        full for now, not for good.
        `vote` rides along in the same round (kvtier.engine.retraction acts on it)."""
        slots = self.window.select(waiting) if self.agree else list(waiting)
        held, reached = self._reserve(slots, busy, budget)
        agreed = (self.agree or local_agree)(self._payload(slots, held, reached, terminate,
                                                           decode_short, vote))
        for req, hit in zip(slots, agreed.hit):
            req.agreed_hit = hit
        ready = {r.id: pages for r, ok, pages in zip(slots, agreed.ready, agreed.fetched)
                 if ok and r.ticket is not None}
        seen = frozenset(r.id for r, at in zip(slots, reached) if at)
        if agreed.terminate:
            for res in held:
                self._roll_back(res)
            return AdmissionResult((), (), ready, bool(agreed.decode_short), True, seen,
                                   agreed.vote)
        admitted, refused = self._commit(slots, held, agreed, busy, budget)
        return AdmissionResult(admitted, refused, ready, bool(agreed.decode_short), False, seen,
                               agreed.vote)

    def strike(self, req: Request) -> bool:
        """True when `req` has now been refused with nothing running often enough to give up:
        at once on one rank; twice across ranks, where a refusal may be one rank's transient.
        The scheduler counts a lone request's decode-page shortages here too: same rule."""
        self._strikes[req.id] = self._strikes.get(req.id, 0) + 1
        return self._strikes[req.id] >= (2 if self.agree else 1)

    def forgive(self, req: Request) -> None:
        """`req` got what it asked for (or is gone): its past refusals no longer count."""
        self._strikes.pop(req.id, None)

    # ---- reserve ---------------------------------------------------------------------------
    def _reserve(self, slots: list[Request], busy: bool,
                 budget: Budget) -> tuple[list[_Reservation | None], list[bool]]:
        """Lookups and L1 pages for the candidates this rank's budget reaches, in order (None:
        not reserved: its L3 prefetch still runs here, or the scan stopped before it); the
        scan mirrors what a commit of each would spend, on a copy of the budget. Also which
        candidates the scan reached with budget left (a best_effort prefetch ends there)."""
        local = dataclasses.replace(budget)
        held: list[_Reservation | None] = [None] * len(slots)
        reached = [False] * len(slots)
        for i, req in enumerate(slots):
            if local.left <= 0:
                break
            reached[i] = True
            if req.incoming is not None:  # a hand-off: its pages are held, nothing to compute
                held[i] = self._reserve_handoff(req)
                continue
            if req.ticket is not None:
                continue  # waits for its prefetch; the requests behind it may go
            load, first_chunk = self._estimate(req)
            if local.used and load + first_chunk > local.left:
                break  # FCFS: nobody overtakes a request that waits for budget
            quota = self.max_load_pages
            if local.used:  # a load this request cannot afford is refused, never over budget
                affordable = (local.left - first_chunk) // self.page_size
                quota = affordable if quota is None else min(quota, affordable)
            res = held[i] = self._reserve_one(req, quota)
            # The copy has started, whatever follows.
            local.charge_load(res.lookup.host_loaded_length)
            if res.fresh is None:
                if self.agree or busy or any(h is not None and h.fresh is not None for h in held):
                    break  # L1 is full for now; at TP=1 with nothing running it is NO_MEMORY
                self.cache.abort(res.lookup)  # unlock now: the next candidate may evict it
                held[i] = res._replace(released=True)
                continue
            local.plan_chunks(req, start=res.usable)
        return held, reached

    def _estimate(self, req: Request) -> tuple[int, int]:
        """(load-back tokens, first chunk tokens) admission would cost. A peek at the tree
        (no lock, no LRU touch), because `lookup` commits: it locks and starts the load."""
        m = self.cache.peek(req.prompt, req.cache_salt)
        load = m.host_hit_length
        if load < self.cache.config.load_back_threshold_tokens:
            load = 0
        n = len(req.prompt)
        usable = self.runner.usable_prefix(m.device_hit_length + load, n)
        if not self.runner.deterministic:
            return load, min(n - usable, self.chunk)
        return load, min(n, (usable // self.chunk + 1) * self.chunk) - usable

    def _reserve_one(self, req: Request, quota: int | None) -> _Reservation:
        cache, n, p = self.cache, len(req.prompt), self.page_size
        lookup = cache.lookup(req.prompt, max_load_pages=quota, salt=req.cache_salt)
        usable = self.runner.usable_prefix(lookup.cached_len, n, cache.window_check(lookup))
        shared = usable // p  # cached pages past `usable` are recomputed into fresh pages:
        fresh, need = None, usable  # never write into a shared page
        if self.agree is not None and shared:
            # Another rank may hit less: with every prompt page fresh, any agreed prefix fits.
            fresh = cache.allocate(pages_for(n, p))
            if fresh is not None:
                need = 0
        if fresh is None:  # only its own hit's share: the agreed prefix must be as long
            fresh = cache.allocate(pages_for(n, p) - shared)
        return _Reservation(req, lookup, fresh, usable, need)

    def _payload(self, slots: list[Request], held: list[_Reservation | None],
                 reached: list[bool], terminate: bool, decode_short: bool,
                 vote: RetractionVote) -> AgreementPayload:
        mine = [(r.usable, r.status, r.need, r.lookup.host_loaded_length) if r is not None
                else (0, SLOT_SKIPPED, 0, 0) for r in held]
        usable, ok, need, loaded = (tuple(col) for col in zip(*mine)) if mine else ((),) * 4
        return AgreementPayload(
            usable, ok, need, loaded,
            ready=tuple(int(r.ticket is None or self.cache.prefetch_ready(r.ticket, at))
                        for r, at in zip(slots, reached)),
            waiting=tuple(int(r.ticket is not None) for r in slots),
            fetched=tuple(NO_TICKET if r.ticket is None
                          else r.ticket.start_page + r.ticket.done_pages for r in slots),
            hit=tuple(self._hit(r) for r in slots) if self.share_hits else (),
            count=len(slots), ids=ids_digest([r.id for r in slots]),
            terminate=int(terminate), decode_short=int(decode_short),
            retract_failed=vote.retract_failed, restore_ok=vote.restore_ok)

    def _hit(self, req: Request) -> int:
        peek = self.cache.peek(req.prompt, req.cache_salt)
        return peek.device_hit_length + peek.host_hit_length

    # ---- commit ----------------------------------------------------------------------------
    def _commit(self, slots: list[Request], held: list[_Reservation | None],
                agreed: AgreementPayload,
                busy: bool, budget: Budget) -> tuple[tuple[Admitted, ...], tuple[Request, ...]]:
        """Admit the leading slots every rank reserved; roll back the rest on this rank."""
        admitted: list[Admitted] = []
        refused: list[Request] = []
        stopped = False
        for i, req in enumerate(slots):
            res = held[i]
            if agreed.waiting[i]:  # some rank still fetches its L3 pages: not this step,
                self._roll_back(res)  # but nobody behind it waits
                budget.charge_load(agreed.loaded[i])
                continue
            if req.incoming is not None and agreed.committable(i):
                assert res is not None, "every rank reserved this slot, this one included"
                if self.handoffs.adopt(res.req, res.lookup, agreed.usable[i]):
                    admitted.append(Admitted(req, req.pos))  # decodes from the next step
                continue  # or recomputed from its prompt from the next step on
            if not stopped and agreed.committable(i):
                assert res is not None, "every rank reserved this slot, this one included"
                self._commit_one(res, agreed.usable[i], agreed.loaded[i], budget)
                admitted.append(Admitted(req, budget.plan_chunks(req)))
                continue
            self._roll_back(res)  # loaded pages stay in the tree
            if stopped:
                continue
            budget.charge_load(agreed.loaded[i])  # the copy has started, whatever follows
            # A rank could not allocate, or every rank reserved but one only for its own hit.
            no_room = agreed.ok[i] in (SLOT_FAILED, SLOT_RESERVED)
            # What this step admitted is running too: the queues move only after the scan.
            if no_room and not (busy or admitted) and self.strike(req):
                log.warning("request %d: L1 (%d pages) cannot hold its %d-token prompt next to "
                            "what is locked; raise device_pages", req.id,
                            self.cache.device_pages, len(req.prompt))
                refused.append(req)
                continue  # nothing else is running: the next request may still fit
            stopped = True  # FCFS: it stays waiting, holding nothing, and nobody overtakes it
        return tuple(admitted), tuple(refused)

    def _roll_back(self, res: _Reservation | None) -> None:
        """Give back what a reservation this step does not commit holds on this rank (a
        hand-off keeps its received pages for the next step)."""
        if res is None or res.released:
            return
        if res.req.incoming is not None:
            self.cache.abort(res.lookup)
            return
        self.cache.abort(res.lookup, res.fresh or [])
        self.rolled_back += int(res.fresh is not None)

    def _reserve_handoff(self, req: Request) -> _Reservation:
        """A hand-off's slot: reserved (its pages are held since bootstrap), usable the whole
        prompt when its pages arrived whole on this rank, else nothing (MIN: all recompute)."""
        assert req.incoming is not None
        lookup = self.cache.lookup((), salt=req.cache_salt)  # locks nothing but its root
        usable = len(req.prompt) if self.handoffs.arrived(req) else 0
        return _Reservation(req, lookup, list(req.incoming.pages), usable, 0)

    def _commit_one(self, res: _Reservation, usable: int, loaded: int, budget: Budget) -> None:
        req, lookup, n, p = res.req, res.lookup, len(res.req.prompt), self.page_size
        assert res.fresh is not None and usable <= res.usable
        shared = usable // p
        keep = pages_for(n, p) - shared
        self.cache.trim_sliding(lookup, shared)  # a hybrid model's: the hit's window only
        self.cache.release_pages(res.fresh[keep:])  # the worst-case surplus
        budget.charge_load(loaded)
        req.start_prefill(lookup, lookup.device_pages[:shared] + res.fresh[:keep], shared, usable)
        req.lengths, req.cached = _lengths(lookup, usable, req.storage_hit, req.peer_hit)
        if req.admitted_s is None:
            req.admitted_s = time.perf_counter()
        self.forgive(req)
        log.info("request %d admitted: %s", req.id, req.lengths.describe())


def _lengths(lookup: CacheLookup, usable: int, storage_hit: int,
             peer_hit: int = 0) -> tuple[RequestLengths, CachedTokens]:
    """The five lengths of what the request uses. A hit past `usable` (off the chunk grid) is
    recomputed, so prefix + loaded + extend == prompt length; L3 pages are the tail of the
    load-back span (they hang below what L1/L2 held when the prefetch started). Of the
    prefetched tokens (`storage_hit`), `peer_hit` came from a peer's L2: counted as `peer`,
    the rest as `storage`."""
    device = min(lookup.prefix_len, usable)
    loaded = usable - device
    storage_start = max(lookup.prefix_len, lookup.cached_len - storage_hit)
    storage = min(loaded, max(0, usable - storage_start))
    lengths = RequestLengths(device, lookup.host_hit_length, loaded, storage,
                             lookup.num_tokens - usable)
    peer = min(storage, peer_hit)
    return lengths, CachedTokens(device, loaded - storage, storage - peer, peer)
