"""The scheduler: L3 prefetch while waiting, admission under a token budget, chunked prefill,
continuous batching of decodes, and clean release of everything on finish, abort or preemption.

One step:
  1. collect finished cache copies (`cache.poll`);
  2. finalize the L3 prefetch of every waiting request the last agreement let go (its policy:
     finished, timed out, or best_effort and reached by admission); ask L3 again for a few
     waiting requests the last scan did not reach whose prefetch found too little (rate-limited);
  3. order the waiting queue (lpm: longest agreed hit first, with aging; or fcfs);
  4. reserve the L1 page each decoding sequence needs; if L1 is full, retract the newest
     request (its KV to L2, kept: kvtier.engine.retraction) or preempt it where it cannot be;
  5. plan prefill: running prefills continue first, then admission in queue order: lookup
     (match + load-back within the memory quota), usable prefix, pages for the rest. Load-back,
     prefill and decode tokens count against `token_budget`; the scan stops when the budget or
     L1 runs out, and the request stays waiting holding nothing;
  6. run it: by default as forwards of up to `chunk_tokens` new tokens that batch several
     requests' prefill pieces with every decode (`forward_plan`); in deterministic mode each
     prefill chunk alone on the absolute grid, then the decodes as one batch.

By default a request's whole pages enter the tree while it runs: its prompt's once prefill
is done, then each page its answer fills (`cache.commit`, which moves the lookup's lock down
and frees nothing the request still reads), so a concurrent request with the same prefix and
the next turn of a conversation hit them; `cache.finish` at the end (or on preemption)
stores the rest, unlocks and frees the request's duplicate copies and its partial last page.
In deterministic mode only the prompt's pages go in, when the request ends; until then a
concurrent request with the same prefix computes it itself.

Step 4's admission (TP ranks: reserve -> agree -> commit, one collective per step) is
kvtier.engine.admission; this module is the step loop around it and owns the queues.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple

from kvtier.engine.admission import Admission, Budget
from kvtier.engine.agreement import Agree
from kvtier.engine.queue_order import DEFAULT_MAX_WAIT_STEPS, order_waiting
from kvtier.engine.request import FinishReason, Request, RequestState, pages_for
from kvtier.engine.retraction import Retraction
from kvtier.engine.runner import ModelRunner
from kvtier.engine.step_forwards import StepForwards
from kvtier.errors import ConfigError
from kvtier.policies import SchedulePolicy
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)

HANDED_HOLD_S = 30.0  # a handed-off request's pages wait this long for the decode side's word
RETRY_PREFETCH_S = 0.05  # a waiting request asks L3 again at most this often
RETRIES_PER_STEP = 4  # and a step asks for at most this many requests
MAX_FAILED_READS = 3  # a request whose forward read a failed load's pages this often ends


class StepStats(NamedTuple):
    """What one step did. `loaded_tokens + prefill_tokens <= token_budget`, except in a step
    whose only admission brought a load-back larger than the whole budget (it would otherwise
    never run; a load is far cheaper than recomputing the same tokens)."""

    loaded_tokens: int   # L2->L1 load-back started by this step's admissions
    prefill_tokens: int  # prompt tokens computed
    decode_tokens: int   # sequences decoded (one token each)
    admitted: int
    preempted: int       # restarted from the prompt (retractions: Retraction.counters)
    finished: int
    forwards: int = 0    # model calls this step

    @property
    def budget_tokens(self) -> int:
        return self.loaded_tokens + self.prefill_tokens

    @property
    def idle(self) -> bool:
        return not (self.budget_tokens or self.decode_tokens or self.admitted or self.finished)


class Scheduler:
    """Drives one HierarchicalCache and one ModelRunner over the requests given to `add`."""

    def __init__(self, cache: HierarchicalCache, runner: ModelRunner, token_budget: int = 8192,
                 max_load_pages: int | None = None, agree: Agree | None = None,
                 policy: SchedulePolicy = SchedulePolicy.LPM,
                 max_wait_steps: int = DEFAULT_MAX_WAIT_STEPS) -> None:
        if token_budget < runner.chunk_tokens:
            raise ConfigError(f"token_budget ({token_budget}) is below chunk_tokens "
                              f"({runner.chunk_tokens}): no prefill chunk could ever run; raise "
                              f"the budget or lower chunk_tokens")
        self.cache, self.runner = cache, runner
        self.page_size, self.chunk = runner.page_size, runner.chunk_tokens
        self.deterministic = runner.deterministic
        self.token_budget = token_budget
        self.policy = SchedulePolicy.parse(policy, "schedule_policy")
        self.max_wait_steps = max_wait_steps
        self.admission = Admission(cache, runner, max_load_pages, agree,
                                   share_hits=self.policy is SchedulePolicy.LPM)
        self.forwards = StepForwards(runner, cache.sliding)
        self.retraction = Retraction(cache, self.page_size)  # retracted requests' L2 copies
        self.waiting: list[Request] = []  # in admission order (see queue_order)
        self.running: list[Request] = []  # prefilling, decoding, retracted; admission order
        self.last_step = StepStats(0, 0, 0, 0, 0, 0)
        self._preempted = 0
        self.terminate_requested = False  # set locally; the agreed flag aborts everything
        # decode side: L1 pages reserved for hand-offs whose prompt KV has not come yet (the
        # engine sets it from its HandoffDesk before each step); they free up when the KV comes or
        # the hold ends, so a prompt that does not fit next to them waits, never refused
        self.handoffs_reserved = False
        self._agreed_ready: dict[int, int] = {}  # id -> prompt page up to which every rank's
        # finished prefetch landed (the MIN): what each rank takes from it
        self._decode_short = False  # this step, a rank could not give a decoding sequence a page
        self._reached: frozenset[int] = frozenset()  # ids the last admission scan reached
        # prefill side of a hand-off: finished requests whose pages wait (untouched) until
        # the decode side has their KV; id -> (request, monotonic deadline)
        self.handed: dict[int, tuple[Request, float]] = {}
        self.handed_hold_s = HANDED_HOLD_S
        self._settled: list[Request] = []  # finished when added (`_settle`): the next step's
        self._failed_reads: dict[int, int] = {}  # request id -> forwards that read a failed load

    # Admission holds these; they stay readable (and `agree` settable: a rank actor sets it
    # after the Engine is built) here, as before admission had its own module.
    @property
    def agree(self) -> Agree | None:
        return self.admission.agree

    @agree.setter
    def agree(self, agree: Agree | None) -> None:
        self.admission.agree = agree

    @property
    def max_load_pages(self) -> int | None:
        return self.admission.max_load_pages

    @max_load_pages.setter
    def max_load_pages(self, pages: int | None) -> None:
        self.admission.max_load_pages = pages

    @property
    def rolled_back(self) -> int:
        return self.admission.rolled_back

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._settled)

    def add(self, req: Request) -> None:
        need = pages_for(len(req.prompt), self.page_size)
        if req.done or (req.resumed and need > self.cache.device_pages):
            self._settle(req, need)  # a Resume that brought the whole answer, or that made
            return  # the prompt too long for L1 (the answer had grown that long)
        if need > self.cache.device_pages:
            raise ConfigError(f"a {len(req.prompt)}-token prompt needs {need} L1 pages but the "
                              f"device pool has {self.cache.device_pages}; raise "
                              f"device_pages or shorten the prompt")
        # L3 -> L2 runs while the request waits
        req.ticket = self.cache.prefetch(req.prompt, salt=req.cache_salt)
        req.prefetch_asked_s = time.monotonic()
        self.waiting.append(req)

    def _settle(self, req: Request, need: int) -> None:
        """Finish a request that was just added without running it (the next step returns
        it): its answer is complete, or L1 cannot hold what it must recompute."""
        if req.done:
            stopped = any(t in req.params.stops for t in req.answer)
            reason = FinishReason.STOP if stopped else FinishReason.LENGTH
        else:
            log.warning("request %d: going on after %d answer tokens needs %d L1 pages, the "
                        "device pool has %d; stopping it there", req.id, len(req.answer), need,
                        self.cache.device_pages)
            reason = FinishReason.NO_MEMORY
        req.finish(reason)
        self._settled.append(req)

    def add_received(self, req: Request) -> None:
        """Queue a decode request whose prompt KV a prefill rank wrote (`req.incoming`):
        admission adopts it once every rank has it whole (no L3 prefetch: nothing to fetch)."""
        assert req.incoming is not None
        self.waiting.append(req)

    def step(self) -> list[Request]:
        """One scheduling step; returns the requests that finished in it."""
        self.cache.poll()
        self._expire_handed()
        self._finalize_prefetches()
        self._retry_prefetches()
        self.waiting = order_waiting(self.waiting, self.policy, self.max_wait_steps)
        finished, self._settled = self._settled, []
        self._preempted, self._decode_short = 0, False
        decoding = self._reserve_decode_pages(finished)
        budget = Budget(self._prefill_budget(len(decoding)), self.chunk, self.deterministic)
        plan = [(r, budget.plan_chunks(r)) for r in self.running
                if r.state is RequestState.PREFILLING]
        admitted = self._admit(budget, plan, finished)
        if self._decode_short:  # some rank lacks a decode page: all ranks skip decode once
            self._make_decode_room(finished)
            decoding = []
        for req in decoding:  # it got its page on every rank: a past shortage is over
            self.admission.forgive(req)
        ended: list[Request] = []  # sampled their last token in this step's forwards
        self.forwards.run([(r, s) for r, s in plan if r.state is RequestState.PREFILLING],
                          [r for r in decoding if r.state is RequestState.DECODING], ended)
        self._recompute_failed_reads(finished)
        for req in ended:
            self._finish(req, req.finish_reason)
            finished.append(req)
        self._commit_filled_pages()
        for req in self.waiting:
            req.waited_steps += 1
        self.last_step = StepStats(budget.loaded, budget.prefill, len(decoding), admitted,
                                   self._preempted, len(finished), self.forwards.count)
        return finished

    def _prefill_budget(self, decodes: int) -> int:
        """Decode tokens come out of the budget in default mode (they share its forwards); at
        least a page is left for prefill, so admission never stalls behind decodes."""
        if self.deterministic:
            return self.token_budget
        return max(self.page_size, self.token_budget - decodes)

    def holds(self, request_id: int) -> bool:
        """Whether a request of this id waits, runs, or is handed off here."""
        return request_id in self.handed or any(
            req.id == request_id for req in self.waiting + self.running)

    def abort(self, request_id: int) -> Request | None:
        """Stop a request at any stage, releasing all it holds; None if it is not here."""
        for req in self.waiting + self.running:
            if req.id == request_id:
                self._finish(req, FinishReason.ABORTED)
                return req
        return None

    # ---- waiting ---------------------------------------------------------------------------
    def _finalize_prefetches(self) -> None:
        """End the prefetches the last agreement let go (every rank takes the pages all of
        them landed by then). One rank alone takes all it has, and does not wait a step for
        a prefetch that finished or timed out since."""
        agreed, self._agreed_ready = self._agreed_ready, {}
        for req in self.waiting:
            if req.ticket is None:
                continue
            if self.agree is None:
                if req.id in agreed or self.cache.prefetch_ready(req.ticket):
                    req.prefetched(req.ticket.source, self.cache.finish_prefetch(req.ticket))
                    req.ticket = None
            elif req.id in agreed:
                pages = max(0, agreed[req.id] - req.ticket.start_page)
                req.prefetched(req.ticket.source,
                               self.cache.finish_prefetch(req.ticket, pages))
                req.ticket = None

    def _retry_prefetches(self) -> None:
        """Ask L3 again for waiting requests whose prefetch found too little (none at arrival,
        or one that ended) before admission reaches them: another instance may have stored
        more of their prefix since. At most every RETRY_PREFETCH_S per request and
        RETRIES_PER_STEP per step (a lookup may be a call to the L3 directory). A retry is
        rank-local like any prefetch: a rank that starts one makes the request wait on every
        rank (the agreement's `waiting`), a rank that finds nothing lets it go."""
        now, left = time.monotonic(), RETRIES_PER_STEP
        for req in self.waiting:
            if left == 0:
                return
            if (req.ticket is not None or req.id in self._reached
                    or now - req.prefetch_asked_s < RETRY_PREFETCH_S):
                continue
            left -= 1
            req.prefetch_asked_s = now
            req.ticket = self.cache.prefetch(req.prompt, retry=True, salt=req.cache_salt)

    def _admit(self, budget: Budget, plan: list[tuple[Request, int]],
               finished: list[Request]) -> int:
        """Run admission, then move what it decided between the queues (which this owns)."""
        vote = self.retraction.vote(self.running)  # restore before new prompts take L1
        # L1 held for now, not for good: what runs, and a decode side's hand-offs (their
        # reservations, and requests whose received KV waits for adoption)
        busy = bool(self.running) or self.handoffs_reserved or \
            any(r.incoming is not None for r in self.waiting)
        result = self.admission.admit([] if self.retraction.holding else self.waiting,
                                      busy, budget,
                                      terminate=self.terminate_requested,
                                      decode_short=self._decode_short, vote=vote)
        self._agreed_ready, self._decode_short = result.ready, result.decode_short
        self._reached = result.reached
        settled = self.retraction.settle(result.vote, bool(self._holders()),
                                         self.agree is not None)
        for req in settled.fallbacks:
            self._preempt(req)
        if result.terminate:
            self._terminate(finished)
            return 0
        for req, stop in result.admitted:
            self.waiting.remove(req)
            self.running.append(req)
            plan.append((req, stop))
        for req in result.refused:
            self._finish(req, FinishReason.NO_MEMORY)
            finished.append(req)
        return len(result.admitted)

    def _terminate(self, finished: list[Request]) -> None:
        log.warning("a rank asked to terminate: aborting %d requests",
                    len(self.waiting) + len(self.running))
        for req in self.waiting + self.running:
            self._finish(req, FinishReason.ABORTED)
            finished.append(req)

    # ---- prefill ---------------------------------------------------------------------------
    def _recompute_failed_reads(self, finished: list[Request]) -> None:
        """Requests whose logits came out non-finite read pages that an L2->L1 load failed
        to fill on some rank (its forward poisoned their rows; the all-reduce took that to
        every rank: kvtier.engine.step_forwards). They restart from their prompts, their
        sampled token discarded, and so does every prefilling request that computed nothing
        yet (it may hold pages of that load it has not read yet; it loses nothing). Only
        requests admitted since a load started can use its pages, so none else can hold
        them; releasing them takes the load's runs out of L1 (the cache keeps their L2
        copies). Every rank does the same, from what every rank saw. A request that fails
        MAX_FAILED_READS times ends with an error instead of looping."""
        failed = self.forwards.failed
        if not failed:
            return
        unstarted = [r for r in self.running if r.state is RequestState.PREFILLING
                     and r not in failed and r.pos == r.num_shared * self.page_size]
        log.warning("requests %s read KV that an L2->L1 load failed to fill; recomputing them "
                    "and %d prefilling requests that had computed nothing",
                    [r.id for r in failed], len(unstarted))
        for req in failed:
            strikes = self._failed_reads[req.id] = self._failed_reads.get(req.id, 0) + 1
            if strikes < MAX_FAILED_READS:
                self._preempt(req)
                continue
            log.error("request %d: its forwards read unusable KV %d times; ending it", req.id,
                      strikes)
            req.fail(f"its cached KV failed to load {strikes} times")
            self._finish(req, FinishReason.ERROR)
            finished.append(req)
        for req in unstarted:
            self._preempt(req)

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
                elif len(self._holders()) > 1:
                    self._push_out(self._holders()[-1])
                else:
                    log.warning("request %d: L1 is full with nothing left to preempt; "
                                "stopping it after %d tokens", req.id, len(req.output))
                    self._finish(req, FinishReason.NO_MEMORY)
                    finished.append(req)
        return [r for r in self.running if r.state is RequestState.DECODING]

    def _make_decode_room(self, finished: list[Request]) -> None:
        """TP ranks: retract or preempt the newest request (pages allocated meanwhile stay
        with their sequences); a lone request is stopped when the shortage persists for two
        steps."""
        holders = self._holders()
        if len(holders) > 1:
            self._push_out(holders[-1])
        elif holders and self.admission.strike(holders[0]):
            req = holders[0]
            log.warning("request %d: L1 is full on some rank with nothing left to preempt; "
                        "stopping it after %d tokens", req.id, len(req.output))
            self._finish(req, FinishReason.NO_MEMORY)
            finished.append(req)

    def _holders(self) -> list[Request]:
        """The running requests that hold L1 pages (a retracted one holds none), oldest first."""
        return [r for r in self.running if r.state is not RequestState.RETRACTED]

    def _push_out(self, req: Request) -> None:
        """Make room in L1: retract `req` (its KV to L2, its output kept), or where that
        cannot be (not decoding, no L2 room, a hybrid model) preempt it."""
        if not self.retraction.retract(req, self._release, agreed=self.agree is not None):
            self._preempt(req)

    def _commit_filled_pages(self) -> None:
        """Default mode: hand each decoding request's newly filled pages to the tree (its
        prompt's right after prefill, then every page its answer fills), so a concurrent
        request with the same prefix, or a long generation's next turn, hits them while it
        still runs. Every TP rank does it at the same step: decode progress is replicated."""
        if self.deterministic:
            return  # only prompt pages, at the end (see _release)
        for req in self.running:
            if req.state is not RequestState.DECODING:
                continue
            computed = req.computed
            full = len(computed) // self.page_size
            if full > req.committed_pages:
                req.lookup = self.cache.commit(req.lookup, computed, req.pages[:full])
                req.committed_pages = full

    # ---- hand-off (prefill side) ---------------------------------------------------------------
    def release_handoff(self, request_id: int) -> bool:
        """The decode side has the handed-off request's KV (or gave up on it): its pages go to
        this cache like any finished request's (prompt pages as cached prefixes)."""
        held = self.handed.pop(request_id, None)
        if held is None:
            return False
        self._store_decoded(held[0])
        return True

    def _expire_handed(self) -> None:
        now = time.monotonic()
        for req_id in [i for i, (_, deadline) in self.handed.items() if deadline <= now]:
            log.warning("request %d: no word from the decode side in %.0f s; releasing its "
                        "handed-off pages", req_id, self.handed_hold_s)
            self.release_handoff(req_id)

    # ---- release ---------------------------------------------------------------------------
    def _release(self, req: Request) -> None:
        """Hand the request's pages back: to the tree (a complete prompt) or the free list."""
        cache = self.cache
        if req.state is RequestState.DECODING:
            self._store_decoded(req)
        elif req.state is RequestState.PREFILLING:
            cache.abort(req.lookup, req.own_pages)  # partial KV: never cached
        elif req.state is RequestState.RETRACTED:
            self.retraction.drop(req)  # its own L2 copy; its L1 pages went when it retracted
        elif req.ticket is not None:
            cache.abort_prefetch(req.ticket)
            req.ticket = None
        elif req.incoming is not None:  # a decode request whose KV never got adopted
            cache.release_pages(req.incoming.pages)
            cache.release_host_pages(req.incoming.staged)
            self.admission.handoffs.forget(req.incoming.handoff_id)
            req.incoming = None

    def _store_decoded(self, req: Request) -> None:
        """A request that computed its prompt: its pages to the tree, the rest freed."""
        # Default: prompt and output pages go to the tree (all but the last token, whose
        # KV was never computed). Deterministic: only the prompt's prefill-computed pages;
        # decode writes one row per forward, which is not bit-identical to prefilling the
        # same tokens, so a later prompt containing them would get KV a cold run does not.
        # The tree returns duplicates (the fresh copy of a fully cached prompt's recomputed
        # page) and the partial last page; finish frees those.
        tokens = req.prompt if self.deterministic else req.computed
        kept = pages_for(len(tokens), self.page_size)
        self.cache.finish(req.lookup, tokens, req.pages[:kept])
        self.cache.release_pages(req.pages[kept:])

    def _preempt(self, req: Request) -> None:
        """Back to waiting, holding nothing, its answer kept: by default it goes on after the
        tokens it has (their KV recomputed as prompt), in deterministic mode it runs again from
        its prompt and must repeat them (Request.fold / restart)."""
        log.info("request %d preempted (L1 full) after %d tokens; it is recomputed", req.id,
                 len(req.answer))
        self._release(req)
        self.running.remove(req)
        if self.deterministic:
            req.restart()
        else:
            req.fold()
        self.waiting = order_waiting(self.waiting + [req], self.policy, self.max_wait_steps)
        self._preempted += 1

    def _finish(self, req: Request, reason: FinishReason | None) -> None:
        if (req.handoff_to and req.state is RequestState.DECODING
                and reason not in (FinishReason.ABORTED, FinishReason.ERROR)):
            # its pages are read by the transfer to the decode side: kept until it says so
            self.handed[req.id] = (req, time.monotonic() + self.handed_hold_s)
        else:
            self._release(req)
        self.admission.forgive(req)
        self._failed_reads.pop(req.id, None)
        (self.running if req in self.running else self.waiting).remove(req)
        req.finish(reason)
