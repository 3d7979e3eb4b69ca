"""The scheduler: L3 prefetch while waiting, admission under a token budget, chunked prefill,
continuous batching of decodes, and clean release of everything on finish, abort or preemption.

One step:
  1. collect finished cache copies (`cache.poll`);
  2. finalize the L3 prefetch of EVERY waiting request its policy lets go (not only the ones
     the admission scan reaches: a finished prefetch holds L2 pages and the anchor's protection);
  3. reserve the L1 page each decoding sequence needs, preempting the newest request if L1 is full;
  4. plan prefill: running prefills continue first, then admission in arrival order: lookup
     (match + load-back within the memory quota), usable prefix, pages for the rest. Load-back and
     prefill tokens both count against `token_budget`; the scan stops when the budget or L1 runs
     out, and the request stays waiting holding nothing;
  5. run the planned prefill chunks, one sequence per forward;
  6. decode every sequence that was decoding, as one batch.

A prompt enters the tree when its request ends (or is preempted), not right after prefill:
`cache.finish` unlocks the lookup and frees the partial last page, both of which decode still
needs. Until then a concurrent request with the same prefix computes it itself, which gives
the same KV (invariant 1).

TP ranks (one scheduler each, same request stream) differ only in their caches, so admission
is reserve -> agree -> commit: each rank looks up and allocates for the step's candidates,
then `agree` (one collective, kvtier.engine.agreement) gives every rank the MIN usable prefix
and whether every rank reserved; a candidate any rank could not reserve is rolled back on all.
A rank reserves pages for the whole prompt when it has a hit (freeing the surplus on commit),
so any agreed prefix shorter than its own can be recomputed into fresh pages; if only its
own-hit share fits, it says so (`need`) and the slot commits only if the MIN is that long.
L3 prefetch readiness is agreed in the same round and acted on at the next step's start.
With `agree=None` (TP=1) none of this changes what a single scheduler does.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

from kvtier.engine.agreement import (SLOT_FAILED, SLOT_RESERVED, SLOT_SKIPPED, Agree,
                                     AgreementPayload, local_agree)
from kvtier.engine.request import CachedTokens, FinishReason, Request, RequestState, pages_for
from kvtier.engine.runner import ModelRunner, chunk_bounds
from kvtier.errors import ConfigError
from kvtier.tiers.cache_types import CacheLookup, RequestLengths
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)


class StepStats(NamedTuple):
    """What one step did. `loaded_tokens + prefill_tokens <= token_budget`, except in a step
    whose only admission brought a load-back larger than the whole budget (it would otherwise
    never run; a load is far cheaper than recomputing the same tokens)."""

    loaded_tokens: int   # L2->L1 load-back started by this step's admissions
    prefill_tokens: int  # prompt tokens computed
    decode_tokens: int   # sequences decoded (one token each; not counted in the budget)
    admitted: int
    preempted: int
    finished: int

    @property
    def budget_tokens(self) -> int:
        return self.loaded_tokens + self.prefill_tokens

    @property
    def idle(self) -> bool:
        return not (self.budget_tokens or self.decode_tokens or self.admitted or self.finished)


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


class _Budget:
    def __init__(self, tokens: int) -> None:
        self.left, self.loaded, self.prefill = tokens, 0, 0

    @property
    def used(self) -> int:
        return self.loaded + self.prefill


class Scheduler:
    """Drives one HierarchicalCache and one ModelRunner over the requests given to `add`."""

    def __init__(self, cache: HierarchicalCache, runner: ModelRunner, token_budget: int = 8192,
                 max_load_pages: int | None = None, agree: Agree | None = None) -> None:
        if token_budget < runner.chunk_tokens:
            raise ConfigError(f"token_budget ({token_budget}) is below chunk_tokens "
                              f"({runner.chunk_tokens}): no prefill chunk could ever run; raise "
                              f"the budget or lower chunk_tokens")
        self.cache, self.runner = cache, runner
        self.page_size, self.chunk = runner.page_size, runner.chunk_tokens
        self.token_budget = token_budget
        self.max_load_pages = max_load_pages  # memory quota for one request's load-back
        self.waiting: list[Request] = []  # arrival order
        self.running: list[Request] = []  # prefilling and decoding, admission order
        self.last_step = StepStats(0, 0, 0, 0, 0, 0)
        self._preempted = 0
        self.agree = agree  # None: one rank, nothing to agree on (TP=1)
        self.terminate_requested = False  # set locally; the agreed flag aborts everything
        self.rolled_back = 0  # reservations undone because some rank could not make them
        self._agreed_ready: set[int] = set()  # request ids whose prefetch all ranks finished
        self._strikes: dict[int, int] = {}  # request id -> steps refused with nothing running
        self._decode_short = False  # this step, a rank could not give a decoding sequence a page

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, req: Request) -> None:
        need = pages_for(len(req.prompt), self.page_size)
        if need > self.cache.device_pool.num_pages:
            raise ConfigError(f"a {len(req.prompt)}-token prompt needs {need} L1 pages but the "
                              f"device pool has {self.cache.device_pool.num_pages}; raise "
                              f"device_pages or shorten the prompt")
        req.ticket = self.cache.prefetch(req.prompt)  # L3 -> L2 runs while the request waits
        self.waiting.append(req)

    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that finished in it."""
        self.cache.poll()
        self._finalize_prefetches()
        self._preempted, finished, self._decode_short = 0, [], False
        decoding = self._reserve_decode_pages(finished)
        budget = _Budget(self.token_budget)
        plan = [(r, self._plan_chunks(r, budget)) for r in self.running
                if r.state is RequestState.PREFILLING]
        admitted = self._admit(budget, plan, finished)
        if self._decode_short:  # some rank lacks a decode page: all ranks skip decode once
            self._make_decode_room(finished)
            decoding = []
        for req in decoding:  # it got its page on every rank: a past shortage is over
            self._strikes.pop(req.id, None)
        for req, stop in plan:
            if req.state is RequestState.PREFILLING and stop > req.pos:
                self._prefill(req, stop, finished)
        self._decode([r for r in decoding if r.state is RequestState.DECODING], finished)
        self.last_step = StepStats(budget.loaded, budget.prefill, len(decoding), admitted,
                                   self._preempted, len(finished))
        return finished

    def abort(self, request_id: int) -> Request | None:
        """Stop a request at any stage, releasing all it holds; None if it is not here."""
        for req in self.waiting + self.running:
            if req.id == request_id:
                self._finish(req, FinishReason.ABORTED)
                return req
        return None

    # ---- waiting ---------------------------------------------------------------------------
    def _finalize_prefetches(self) -> None:
        agreed, self._agreed_ready = self._agreed_ready, set()
        for req in self.waiting:
            if req.ticket is None:
                continue
            if req.id in agreed if self.agree else self.cache.prefetch_ready(req.ticket):
                req.storage_hit = self.cache.finish_prefetch(req.ticket)
                req.ticket = None

    def _admit(self, budget: _Budget, plan: list[tuple[Request, int]],
               finished: list[Request]) -> int:
        """Reserve on this rank, agree across ranks (once per step), commit what all reserved."""
        slots = [r for r in self.waiting if r.ticket is None]
        held = self._reserve(slots, budget)
        prefetching = [r for r in self.waiting if r.ticket is not None] if self.agree else []
        agreed = (self.agree or local_agree)(self._payload(slots, held, prefetching))
        self._agreed_ready = {r.id for r, ok in zip(prefetching, agreed.ready) if ok}
        self._decode_short = bool(agreed.decode_short)
        if agreed.terminate:
            for res in held:
                self.cache.abort(res.lookup, res.fresh or [])
            self._terminate(finished)
            return 0
        return self._commit(slots, held, agreed, budget, plan, finished)

    def _reserve(self, slots: list[Request], budget: _Budget) -> list[_Reservation]:
        """Lookups and L1 pages for the candidates this rank's budget reaches, in order; the
        scan mirrors what a commit of each would spend, on a copy of the budget."""
        local = _Budget(budget.left)
        local.loaded, local.prefill = budget.loaded, budget.prefill
        held: list[_Reservation] = []
        for req in slots:
            if local.left <= 0:
                break
            load, first_chunk = self._estimate(req)
            if local.used and load + first_chunk > local.left:
                break  # FCFS: nobody overtakes a request that waits for budget
            quota = self.max_load_pages
            if local.used:  # a load this request cannot afford is refused, never over budget
                affordable = (local.left - first_chunk) // self.page_size
                quota = affordable if quota is None else min(quota, affordable)
            res = self._reserve_one(req, quota)
            held.append(res)
            local.loaded += res.lookup.host_loaded_length  # the copy has started, whatever follows
            local.left -= res.lookup.host_loaded_length
            if res.fresh is None:
                if self.agree or self.running or any(h.fresh is not None for h in held):
                    break  # L1 is full for now; at TP=1 with nothing running it is NO_MEMORY
                self.cache.abort(res.lookup)  # unlock now: the next candidate may evict it
                held[-1] = res._replace(released=True)
                continue
            self._plan_chunks(req, local, start=res.usable)
        return held

    def _estimate(self, req: Request) -> tuple[int, int]:
        """(load-back tokens, first chunk tokens) admission would cost. A peek at the tree
        (no lock, no LRU touch), because `lookup` commits: it locks and starts the load."""
        m = self.cache.tree.match_prefix(req.prompt, touch=False)
        load = m.host_hit_length
        if load < self.cache.config.load_back_threshold_tokens:
            load = 0
        n = len(req.prompt)
        usable = self.runner.usable_prefix(m.device_hit_length + load, n)
        return load, min(n, (usable // self.chunk + 1) * self.chunk) - usable

    def _reserve_one(self, req: Request, quota: int | None) -> _Reservation:
        cache, n, p = self.cache, len(req.prompt), self.page_size
        lookup = cache.lookup(req.prompt, max_load_pages=quota)
        usable = self.runner.usable_prefix(lookup.cached_len, n)
        shared = usable // p  # cached pages past `usable` are recomputed into fresh pages:
        fresh, need = None, usable  # never write into a shared page
        if self.agree is not None and shared:
            # Another rank may hit less: with every prompt page fresh, any agreed prefix fits.
            fresh, need = cache.allocate(pages_for(n, p)), 0
        if fresh is None:
            fresh = cache.allocate(pages_for(n, p) - shared)
        return _Reservation(req, lookup, fresh, usable, need)

    def _payload(self, slots: list[Request], held: list[_Reservation],
                 prefetching: list[Request]) -> AgreementPayload:
        skipped = len(slots) - len(held)
        return AgreementPayload(
            usable=tuple(r.usable for r in held) + (0,) * skipped,
            ok=tuple(r.status for r in held) + (SLOT_SKIPPED,) * skipped,
            need=tuple(r.need for r in held) + (0,) * skipped,
            loaded=tuple(r.lookup.host_loaded_length for r in held) + (0,) * skipped,
            ready=tuple(int(self.cache.prefetch_ready(r.ticket)) for r in prefetching),
            terminate=int(self.terminate_requested), decode_short=int(self._decode_short))

    def _commit(self, slots: list[Request], held: list[_Reservation], agreed: AgreementPayload,
                budget: _Budget, plan: list[tuple[Request, int]], finished: list[Request]) -> int:
        """Admit the leading slots every rank reserved; roll back the rest on this rank."""
        admitted, stopped = 0, False
        for i, req in enumerate(slots):
            res = held[i] if i < len(held) else None
            if not stopped and agreed.committable(i):
                assert res is not None, "every rank reserved this slot, this one included"
                self._commit_one(res, agreed.usable[i], agreed.loaded[i], budget)
                plan.append((req, self._plan_chunks(req, budget)))
                admitted += 1
                continue
            if res is not None and not res.released:
                self.cache.abort(res.lookup, res.fresh or [])  # loaded pages stay in the tree
                self.rolled_back += int(res.fresh is not None)
            if stopped:
                continue
            budget.loaded += agreed.loaded[i]  # the copy has started, whatever follows
            budget.left -= agreed.loaded[i]
            # A rank could not allocate, or every rank reserved but one only for its own hit.
            no_room = agreed.ok[i] in (SLOT_FAILED, SLOT_RESERVED)
            if no_room and not self.running and self._strike(req):
                log.warning("request %d: L1 (%d pages) cannot hold its %d-token prompt next to "
                            "what is locked; raise device_pages", req.id,
                            self.cache.device_pool.num_pages, len(req.prompt))
                self._finish(req, FinishReason.NO_MEMORY)
                finished.append(req)
                continue  # nothing else is running: the next request may still fit
            stopped = True  # FCFS: it stays waiting, holding nothing, and nobody overtakes it
        return admitted

    def _strike(self, req: Request) -> bool:
        """True when `req` has now been refused with nothing running often enough to give up:
        at once on one rank; twice across ranks, where a refusal may be one rank's transient."""
        self._strikes[req.id] = self._strikes.get(req.id, 0) + 1
        return self._strikes[req.id] >= (2 if self.agree else 1)

    def _commit_one(self, res: _Reservation, usable: int, loaded: int, budget: _Budget) -> None:
        req, lookup, n, p = res.req, res.lookup, len(res.req.prompt), self.page_size
        assert res.fresh is not None and usable <= res.usable
        shared = usable // p
        keep = pages_for(n, p) - shared
        self.cache.device_pool.allocator.free(res.fresh[keep:])  # the worst-case surplus
        budget.loaded += loaded
        budget.left -= loaded
        req.lookup, req.pages, req.num_shared, req.pos = \
            lookup, lookup.device_pages[:shared] + res.fresh[:keep], shared, usable
        req.lengths, req.cached = _lengths(lookup, usable, req.storage_hit)
        req.state = RequestState.PREFILLING
        self._strikes.pop(req.id, None)
        self.waiting.remove(req)
        self.running.append(req)
        log.info("request %d admitted: %s", req.id, req.lengths.describe())

    def _terminate(self, finished: list[Request]) -> None:
        log.warning("a rank asked to terminate: aborting %d requests",
                    len(self.waiting) + len(self.running))
        for req in self.waiting + self.running:
            self._finish(req, FinishReason.ABORTED)
            finished.append(req)

    # ---- prefill ---------------------------------------------------------------------------
    def _plan_chunks(self, req: Request, budget: _Budget, start: int | None = None) -> int:
        """How far `req` prefills this step: whole grid chunks while the budget lasts."""
        stop = req.pos if start is None else start
        for lo, hi in chunk_bounds(stop, len(req.prompt), self.chunk):
            if hi - lo > budget.left:
                break
            budget.left -= hi - lo
            budget.prefill += hi - lo
            stop = hi
        return stop

    def _prefill(self, req: Request, stop: int, finished: list[Request]) -> None:
        # One sequence per forward: a matmul's rows depend on how many run together, so
        # batching two prompts' chunks would break bit-identity with a cold run (invariant 1).
        logits = self.runner.prefill(req.prompt[:stop], req.pos, req.pages)
        req.pos = stop
        if stop < len(req.prompt):
            return
        req.prefill_logits = logits.float().cpu()
        req.state = RequestState.DECODING
        if req.append(req.sampler(logits)):
            self._finish(req, req.finish_reason)
            finished.append(req)

    # ---- decode ----------------------------------------------------------------------------
    def _reserve_decode_pages(self, finished: list[Request]) -> list[Request]:
        """Give each decoding sequence the page its next token needs; preempt when L1 is full."""
        for req in [r for r in self.running if r.state is RequestState.DECODING]:
            while req.state is RequestState.DECODING and \
                    len(req.pages) < pages_for(req.kv_len + 1, self.page_size):
                page = self.cache.allocate(1)
                if page is not None:
                    req.pages += page
                elif self.agree is not None:
                    self._decode_short = True  # decided by all ranks after the agreement
                    break
                elif len(self.running) > 1:
                    self._preempt(self.running[-1])
                else:
                    log.warning("request %d: L1 is full with nothing left to preempt; "
                                "stopping it after %d tokens", req.id, len(req.output))
                    self._finish(req, FinishReason.NO_MEMORY)
                    finished.append(req)
        return [r for r in self.running if r.state is RequestState.DECODING]

    def _make_decode_room(self, finished: list[Request]) -> None:
        """TP ranks: preempt the newest request (pages allocated meanwhile stay with their
        sequences); a lone request is stopped when the shortage persists for two steps."""
        if len(self.running) > 1:
            self._preempt(self.running[-1])
        elif self.running and self._strike(self.running[0]):
            req = self.running[0]
            log.warning("request %d: L1 is full on some rank with nothing left to preempt; "
                        "stopping it after %d tokens", req.id, len(req.output))
            self._finish(req, FinishReason.NO_MEMORY)
            finished.append(req)

    def _decode(self, batch: list[Request], finished: list[Request]) -> None:
        if not batch:
            return
        logits = self.runner.decode([r.output[-1] for r in batch],
                                    [(r.pages, r.kv_len) for r in batch])
        for row, req in enumerate(batch):
            if req.append(req.sampler(logits[row])):
                self._finish(req, req.finish_reason)
                finished.append(req)

    # ---- release ---------------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        """Hand the request's pages back: to the tree (a complete prompt) or the free list."""
        cache = self.cache
        if req.state is RequestState.DECODING:
            # Only the prompt's prefill-computed pages go to the tree. Decode writes one row
            # per forward, which is not bit-identical to prefilling the same tokens, so a later
            # prompt containing them would get KV a cold run does not (invariant 1): decode
            # pages are freed. The tree returns duplicates (the fresh copy of a fully cached
            # prompt's recomputed page) and the partial last page; finish frees those.
            prompt_pages = pages_for(len(req.prompt), self.page_size)
            cache.finish(req.lookup, req.prompt, req.pages[:prompt_pages])
            cache.device_pool.allocator.free(req.pages[prompt_pages:])
        elif req.state is RequestState.PREFILLING:
            cache.abort(req.lookup, req.own_pages)  # partial KV: never cached
        elif req.ticket is not None:
            cache.abort_prefetch(req.ticket)
            req.ticket = None

    def _preempt(self, req: Request) -> None:
        log.info("request %d preempted (L1 full): it restarts from its prompt", req.id)
        self._release(req)
        self.running.remove(req)
        req.reset()
        self.waiting.append(req)
        self.waiting.sort(key=lambda r: r.id)  # ids follow arrival: it goes back in its place
        self._preempted += 1

    def _finish(self, req: Request, reason: FinishReason | None) -> None:
        self._release(req)
        self._strikes.pop(req.id, None)
        (self.running if req in self.running else self.waiting).remove(req)
        req.state, req.finish_reason = RequestState.FINISHED, reason
        req.finish_s = time.perf_counter()


def _lengths(lookup: CacheLookup, usable: int,
             storage_hit: int) -> tuple[RequestLengths, CachedTokens]:
    """The five lengths of what the request uses. A hit past `usable` (off the chunk grid) is
    recomputed, so prefix + loaded + extend == prompt length; L3 pages are the tail of the
    load-back span (they hang below what L1/L2 held when the prefetch started)."""
    device = min(lookup.prefix_len, usable)
    loaded = usable - device
    storage_start = max(lookup.prefix_len, lookup.cached_len - storage_hit)
    storage = min(loaded, max(0, usable - storage_start))
    lengths = RequestLengths(device, lookup.host_hit_length, loaded, storage,
                             lookup.num_tokens - usable)
    return lengths, CachedTokens(device, loaded - storage, storage)
