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
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

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


class _Budget:
    def __init__(self, tokens: int) -> None:
        self.left, self.loaded, self.prefill = tokens, 0, 0

    @property
    def used(self) -> int:
        return self.loaded + self.prefill


class Scheduler:
    """Drives one HierarchicalCache and one ModelRunner over the requests given to `add`."""

    def __init__(self, cache: HierarchicalCache, runner: ModelRunner, token_budget: int = 8192,
                 max_load_pages: int | None = None) -> None:
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
        self._preempted, finished = 0, []
        decoding = self._reserve_decode_pages(finished)
        budget = _Budget(self.token_budget)
        plan = [(r, self._plan_chunks(r, budget)) for r in self.running
                if r.state is RequestState.PREFILLING]
        admitted = self._admit(budget, plan, finished)
        for req, stop in plan:
            if req.state is RequestState.PREFILLING and stop > req.pos:
                self._prefill(req, stop, finished)
        self._decode(decoding, finished)
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
        for req in self.waiting:
            if req.ticket is not None and self.cache.prefetch_ready(req.ticket):
                req.storage_hit = self.cache.finish_prefetch(req.ticket)
                req.ticket = None

    def _admit(self, budget: _Budget, plan: list[tuple[Request, int]],
               finished: list[Request]) -> int:
        admitted = 0
        for req in list(self.waiting):
            if budget.left <= 0:
                break
            if req.ticket is not None:
                continue  # its prefetch policy says wait; later arrivals may go meanwhile
            load, first_chunk = self._estimate(req)
            if budget.used and load + first_chunk > budget.left:
                break  # FCFS: nobody overtakes a request that waits for budget
            quota = self.max_load_pages
            if budget.used:  # a load this request cannot afford is refused, never over budget
                affordable = (budget.left - first_chunk) // self.page_size
                quota = affordable if quota is None else min(quota, affordable)
            if not self._start(req, quota, budget, finished):
                break
            if req.state is RequestState.PREFILLING:
                admitted += 1
                plan.append((req, self._plan_chunks(req, budget)))
        return admitted

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

    def _start(self, req: Request, quota: int | None, budget: _Budget,
               finished: list[Request]) -> bool:
        """Lookup, allocate, move to running. False when L1 is full (nothing is kept)."""
        cache, n, p = self.cache, len(req.prompt), self.page_size
        lookup = cache.lookup(req.prompt, max_load_pages=quota)
        budget.loaded += lookup.host_loaded_length  # the copy has started, whatever follows
        budget.left -= lookup.host_loaded_length
        usable = self.runner.usable_prefix(lookup.cached_len, n)
        shared = usable // p  # cached pages past `usable` are recomputed into fresh pages:
        fresh = cache.allocate(pages_for(n, p) - shared)  # never write into a shared page
        if fresh is None:
            cache.abort(lookup)  # what it loaded back stays in L1, owned by the tree
            if not self.running:  # nothing will ever free more: answer instead of hanging
                log.warning("request %d: L1 (%d pages) cannot hold its %d-token prompt next to "
                            "what is locked; raise device_pages", req.id,
                            cache.device_pool.num_pages, n)
                self._finish(req, FinishReason.NO_MEMORY)
                finished.append(req)
                return True
            return False
        req.lookup, req.pages, req.num_shared, req.pos = \
            lookup, lookup.device_pages[:shared] + fresh, shared, usable
        req.lengths, req.cached = _lengths(lookup, usable, req.storage_hit)
        req.state = RequestState.PREFILLING
        self.waiting.remove(req)
        self.running.append(req)
        log.info("request %d admitted: %s", req.id, req.lengths.describe())
        return True

    # ---- prefill ---------------------------------------------------------------------------
    def _plan_chunks(self, req: Request, budget: _Budget) -> int:
        """How far `req` prefills this step: whole grid chunks while the budget lasts."""
        stop = req.pos
        for lo, hi in chunk_bounds(req.pos, len(req.prompt), self.chunk):
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
                elif len(self.running) > 1:
                    self._preempt(self.running[-1])
                else:
                    log.warning("request %d: L1 is full with nothing left to preempt; "
                                "stopping it after %d tokens", req.id, len(req.output))
                    self._finish(req, FinishReason.NO_MEMORY)
                    finished.append(req)
        return [r for r in self.running if r.state is RequestState.DECODING]

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
