"""An Instance: the TP rank actors of one model replica, stepped in lockstep.

The ranks sit in one placement group (PACK: on one node when it fits). Every request goes to
every rank in the same order; each step is one `.remote()` per rank and one bounded `ray.get`
over all of them (actors/rank_group: the ranks meet in their collectives: the agreement round
and the model's all-reduces). Ranks must produce the same outputs; rank 0's are returned.

    with local_ray(2), Instance(RankSettings(TinyWeights(), HiCacheConfig(page_size=16)),
                                tp_size=2) as inst:
        outs = inst.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))

Prefill/decode hand-offs (actors/pd/driver) go through the same instance: rank r of a
prefill instance writes into rank r of its decode instance (equal TP sizes: each rank holds
the same KV heads on both sides), so every per-rank value is a list in rank order.

    decode.handoff_open("nixl"); prefill.handoff_open("nixl")
    targets = decode.reserve_handoff("req-1", len(prompt))      # bootstrap (None: no room)
    pid = prefill.add_prefill(prompt, SamplingParams(max_new_tokens=1), targets)
    ... prefill.step_report().handoffs[pid]                      # each rank's HandoffSent
    did = decode.add_received(prompt, sampling, incoming_kv(...))  # KV-ready, then decode
    prefill.release_handoff(pid)                                 # once the decode side has it

Every hand-off call recovers the instance when a rank fails in it, as a step does
(`_recovering`: the ranks replaced, pending requests added again): what the failed ranks held
died with them (a reservation, handed-off pages), and the call answers as if it were gone
(None, False).
"""
from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Sequence, TypeVar

import ray
from ray.util.placement_group import (placement_group, placement_group_table,
                                      remove_placement_group)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvtier.actors.cluster_placement import unplaced_message
from kvtier.actors.pd.rank_port import RankTransportCounters
from kvtier.actors.rank_actor import (RANK_NUM_CPUS, CacheDescription, Rank, RankSettings,
                                      RankSnapshot, RankStats, create_rank_actor,
                                      pack_rank_settings)
from kvtier.actors.rank_group import (InstanceError, RankDivergence, RankFailure, RankGroup,
                                      wait_ranks)
from kvtier.actors.step_wire import Progress, StepReport
from kvtier.engine.handoff import HandoffSent, HandoffTarget, IncomingKV, rank_sums
from kvtier.engine.handoff_desk import DEFAULT_HOLD_S
from kvtier.engine.request import FinishReason, Output, Resume
from kvtier.engine.sampling import SamplingParams, TokenLogprob
from kvtier.engine.scheduler import HANDED_HOLD_S
from kvtier.engine.tp_group import loopback_init_method
from kvtier.errors import ConfigError, KvtierError, PlacementError
from kvtier.keys import check_cache_salt
from kvtier.frontend.records import RunningConfig
from kvtier.messages import NamespaceInfo
from kvtier.frontend.placement import rank_bundle
from kvtier.tiers.l2_holders import new_incarnation
from kvtier.tiers.peer_pages import PeerReadCounters, RawPeerRead

__all__ = ["Instance", "InstanceError", "InstanceStep", "RankDivergence", "RankFailure"]

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 60.0
MAX_RESTARTS = 3  # rank-set replacements in a row without a completed step
IDLE_WAIT_S = 0.0005
RAW_READ_START_S = 1.0  # peer_raw_read: time for every rank to look its holders up first

T = TypeVar("T")


@ray.remote(num_cpus=0)
def _node_rendezvous() -> str:
    """A rendezvous address free on the node this task runs on (`Instance._rendezvous`)."""
    from kvtier.engine import tp_group  # by name: Ray ships this function by value

    return tp_group.loopback_init_method()


class InstanceStep(NamedTuple):
    finished: list[Output]  # by instance request id
    progress: dict[int, Progress]  # running requests whose answer grew: the new tokens
    events: bytes | None  # rank 0's CacheEventBatch (msgpack), when watching
    handoffs: dict[int, list[HandoffSent]] = {}  # prefill side: id -> each rank's transfer


class InstanceRequestState(enum.Enum):
    """Where a request an instance holds stands (not the engine's scheduling state,
    `engine.request.RequestState`)."""

    PENDING = "pending"  # queued or running on the ranks, not returned yet
    HANDED = "handed"    # prefill side: returned; its ranks hold its pages for the decode side


@dataclass
class InstanceRequest:
    """A request the instance holds: while PENDING, enough to run it again (a prefill again
    to the same decode pages; a decode request over its pages, which a replaced rank no
    longer has: it is then recomputed), and the answer so far, which a run again goes on
    after (`resume`); once HANDED, until when its ranks hold its pages."""

    tokens: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str = ""
    label: str = ""  # its id as its client knows it (the OpenAI id), for the logs
    targets: tuple[HandoffTarget, ...] | None = None  # prefill side: every decode rank's
    incoming: tuple[IncomingKV, ...] | None = None  # decode side: each rank's
    answer: list[int] = field(default_factory=list)  # tokens returned so far (progress)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when it asked
    state: InstanceRequestState = InstanceRequestState.PENDING
    held_until: float = 0.0  # HANDED: monotonic; the ranks have given the pages back by then

    def resume(self) -> Resume | None:
        """What a run again goes on after (None: nothing returned yet)."""
        if not self.answer:
            return None
        logprobs = tuple(self.logprobs) if self.sampling.logprobs is not None else None
        return Resume(tuple(self.answer), logprobs)

    def take(self, progress: Progress) -> Progress | None:
        """Keep what `progress` adds to the answer; that part (None: nothing new)."""
        new = progress.after(len(self.answer))
        if new is None:
            return None
        assert new.start == len(self.answer), "a step skipped answer tokens"
        self.answer += new.tokens
        if new.logprobs is not None:
            self.logprobs += new.logprobs
        return new


class Instance:
    """`tp_size` Rank actors over one request stream; `generate` or `add_request`+`step`.

    Faults: when a rank dies, hangs past `step_timeout_s` or fails a call, the TP group is
    broken for every rank (a collective cannot re-admit one member), so the instance kills
    all its ranks, starts a fresh set in the same placement-group bundles, and adds every
    request it has not returned yet again: each goes on after the answer tokens it already
    returned (their KV and the prompt's recomputed, hitting L3 where the namespace has their
    pages; in deterministic mode the answer is recomputed from the prompt and must repeat
    them), so none is lost and no answer is spliced from two runs. Request ids are the
    instance's own (or its caller's) and survive a restart. After `max_restarts` restarts in
    a row with no step completed between them, the instance gives up with an InstanceError.
    """

    handed_hold_s = HANDED_HOLD_S  # how long the ranks hold a handed-off request's pages
    restarts: int  # rank sets replaced after a fault, over the instance's life
    recovering: bool  # replacing its ranks now (read by other threads: a poll)
    events_when_idle = False  # its ranks record cache events in steps and calls only

    def __init__(self, settings: RankSettings, tp_size: int = 2,
                 num_cpus_per_rank: float = RANK_NUM_CPUS, strategy: str = "PACK",
                 ready_timeout_s: float = READY_TIMEOUT_S,
                 step_timeout_s: float = STEP_TIMEOUT_S,
                 resources: dict[str, float] | None = None,
                 max_restarts: int = MAX_RESTARTS,
                 rank_class: type[Rank] = Rank) -> None:
        """`resources`: custom Ray resources each rank's bundle also asks for (e.g.
        `{"kvtier_instance": 1}`): the ranks land only on nodes that offer them. With
        `settings.gpu` each bundle also asks for one GPU.
        `rank_class`: what each rank actor runs (tests pass a subclass that injects faults)."""
        if tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
        if max_restarts < 0:
            raise ConfigError(f"max_restarts must be >= 0, got {max_restarts}")
        settings.source.config()  # a bad source fails here, not inside every actor
        self.size, self.step_timeout_s = tp_size, step_timeout_s
        self.ready_timeout_s, self.max_restarts = ready_timeout_s, max_restarts
        self._settings, self._num_cpus = settings, num_cpus_per_rank
        self._rank_class = rank_class
        self.restarts = 0
        self.recovering = False
        self.divergences = 0  # of those, the ones caused by ranks out of step
        self._failures_in_a_row = 0
        self._next_id = 0
        self._submitted = 0
        # instance id -> request, in arrival order: the one record of each request
        self._requests: dict[int, InstanceRequest] = {}
        self._done: dict[int, Output] = {}  # returned by a step, not yet asked for by `wait`
        self.call_s = 0.0  # driver time inside step calls (for the actor-call overhead)
        self._l3: tuple[bytes, str | None, bool] | None = None  # what attach_l3 was given
        self._watch: str | None = None  # the name watch_cache was given
        self._transport: tuple[str, bool] | None = None  # what handoff_open was given
        self._peers: tuple[str, str, str, bool] | None = None  # what peer_open was given
        self.rank_group = RankGroup([], step_timeout_s)
        bundle = rank_bundle(num_cpus_per_rank, int(settings.gpu), resources)
        self._pg = placement_group([dict(bundle) for _ in range(tp_size)], strategy=strategy)
        try:
            self._wait_placed(bundle, strategy)
            self._start_ranks()
        except BaseException:
            self.close()
            raise
        log.info("instance ready: TP=%d (%s)", tp_size, strategy)

    @property
    def ranks(self) -> list[Any]:
        """The current rank actors, in rank order (empty while a replacement set starts)."""
        return self.rank_group.actors

    def _wait_placed(self, bundle: dict[str, float], strategy: str) -> None:
        """Wait for the placement group; a PlacementError naming the nodes that offer what
        the bundles ask for if Ray cannot place it within ready_timeout_s."""
        ready, _ = ray.wait([self._pg.ready()], timeout=self.ready_timeout_s)
        if not ready:
            raise PlacementError(unplaced_message(bundle, self.size, strategy,
                                                  self.ready_timeout_s))
        ray.get(ready[0])

    def _rendezvous(self) -> str:
        """The TP group's rendezvous address: a loopback port free on the node of bundle 0,
        where rank 0 listens (all of an instance's ranks share one node). Chosen here when
        that node is this process's, else by a zero-CPU task on it: a port free on the
        driver's host may be taken on the ranks' host."""
        node = placement_group_table(self._pg)["bundles_to_node_id"][0]
        if node == ray.get_runtime_context().get_node_id():
            return loopback_init_method()
        task = _node_rendezvous.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self._pg, placement_group_bundle_index=0))
        return ray.get(task.remote(), timeout=self.ready_timeout_s)

    def _start_ranks(self) -> None:
        init_method = self._rendezvous()
        s = self._settings
        if s.l3 is not None:  # the namespace as it is now (a restarted master moved it)
            info = _current_info(s.l3.to_msgpack(), s.l3_actor)
            self._settings = s = s._replace(l3=NamespaceInfo.from_msgpack(info))
        packed = pack_rank_settings(s)  # once for the set: msgpack, never a pickled source
        self.rank_group = RankGroup([create_rank_actor(r, self.size, init_method, packed,
                                                       self._pg, self._num_cpus,
                                                       self._rank_class)
                                     for r in range(self.size)], self.step_timeout_s)
        group = self.rank_group
        group.has_unfinished(self.ready_timeout_s)
        if self._l3 is not None:  # a replacement set gets the namespace as it is now
            group.attach_l3(_current_info(*self._l3[:2]), *self._l3[1:])
        if self._watch is not None:
            group.watch_cache(self._watch)
        if self._transport is not None:
            group.handoff_open(*self._transport)
        if self._peers is not None:
            group.peer_open(*self._peers)

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, tokens: Sequence[int], sampling: SamplingParams = SamplingParams(),
                    cache_salt: str = "", resume: Resume | None = None,
                    request_id: int | None = None, label: str = "") -> int:
        """Queue a request on every rank; its id (the instance's, stable across restarts).
        `cache_salt`: its tenant (it hits only prefixes cached with the same salt).
        `resume`: the start of its answer the caller has already (it ran elsewhere): it goes
        on after those tokens, which its progress never reports again.
        `request_id`: the id to give it (a server's own request id), instead of the next.
        `label`: its id as its client knows it (the logs name it by that)."""
        req = InstanceRequest(tuple(int(t) for t in tokens), sampling,
                              check_cache_salt(cache_salt), label=label)
        if resume is not None:
            req.answer, req.logprobs = list(resume.tokens), list(resume.logprobs or ())
        return self._add(req, request_id)

    def _add(self, req: InstanceRequest, request_id: int | None = None) -> int:
        if request_id is None:
            request_id = self._next_id
        elif request_id in self._requests:
            raise ConfigError(f"request id {request_id} is in use on this instance; give each "
                              f"request its own")
        self._next_id = max(self._next_id, request_id + 1)
        self._submitted += 1
        self._requests[request_id] = req
        try:
            self._submit(request_id, req)
        except RankFailure as exc:
            self._recover(exc)  # re-adds every pending request, this one too
        return request_id

    def _submit(self, request_id: int, req: InstanceRequest) -> None:
        """Queue pending request `req` on every rank under its instance id (the ranks use
        the same id): new, or again after a restart, when it goes on after the answer it has
        (its hand-off pages died with the old ranks)."""
        args = (request_id, list(req.tokens), req.sampling, req.cache_salt)
        if req.targets is not None:
            ids = self.rank_group.add_handoff_request(*args, req.targets)
        elif req.incoming is not None and not req.answer:
            ids = self.rank_group.add_received(*args, req.incoming)
        else:
            ids = self.rank_group.add_request(*args, req.resume())
        if set(ids) != {request_id}:
            raise RankDivergence(f"ranks gave request {request_id} the ids {ids}: their "
                                 f"streams are out of step")  # recovered like any divergence

    def step(self) -> list[Output]:
        """One lockstep step on every rank; rank 0's finished outputs (checked against all).
        A rank fault replaces the ranks and re-adds pending requests; that step returns []."""
        return self.step_report().finished

    def step_report(self) -> InstanceStep:
        """`step`, with the new tokens of running requests whose answer grew (by instance id;
        each token once, also across a restart: a request goes on after the tokens it
        returned) and rank 0's cache events when `watch_cache` asked for them."""
        start = time.perf_counter()
        try:
            per_rank = self.rank_group.step()
        except RankFailure as exc:
            self._recover(exc)
            return InstanceStep([], {}, None)
        finally:
            self.call_s += time.perf_counter() - start
        first = per_rank[0]
        for rank, report in enumerate(per_rank[1:], start=1):
            got = [(o.request_id, o.tokens, o.finish_reason) for o in report.finished]
            want = [(o.request_id, o.tokens, o.finish_reason) for o in first.finished]
            if got != want:  # nothing of this step is returned: every request recomputes
                self._recover(RankDivergence(f"rank {rank} finished {got} but rank 0 {want}"))
                return InstanceStep([], {}, None)
        self._failures_in_a_row = 0
        pending = {req_id for req_id, req in self._requests.items()
                   if req.state is InstanceRequestState.PENDING}
        progress = {}
        for req_id, got in first.progress.items():
            new = self._requests[req_id].take(got) if req_id in pending else None
            if new is not None:
                progress[req_id] = new
        handoffs = _collect_handoffs(per_rank, pending)
        return InstanceStep([self._finish(o.request_id, o) for o in first.finished],
                            progress, first.events, handoffs)

    def _finish(self, req_id: int, out: Output) -> Output:
        """Request `req_id` finished as `out`: the caller's output. A
        prefill's pages stay held by its ranks for the decode side (unless it was aborted, as
        their scheduler does), until released or their hold ends."""
        req = self._requests.pop(req_id)
        if req.targets is not None:
            self._forget_expired()
            if out.finish_reason is not FinishReason.ABORTED:
                req.state, req.held_until = (InstanceRequestState.HANDED,
                                             time.monotonic() + self.handed_hold_s)
                self._requests[req_id] = req
        return out

    def _recover(self, cause: RankFailure) -> None:
        """Replace every rank and queue the pending requests again, in arrival order."""
        self.recovering = True
        try:
            self._replace_ranks(cause)
        finally:
            self.recovering = False

    def _replace_ranks(self, cause: RankFailure) -> None:
        self._failures_in_a_row += 1
        if self._failures_in_a_row > self.max_restarts:
            raise InstanceError(f"{cause}; the ranks failed {self._failures_in_a_row} times "
                                f"in a row, giving up (max_restarts={self.max_restarts})"
                                ) from cause
        log.warning("%s; replacing all %d ranks and recomputing %d pending requests%s",
                    cause, self.size, self.num_pending, _labels(self._requests.values()))
        self.divergences += isinstance(cause, RankDivergence)
        self.rank_group.kill_all()
        for req_id in list(self._requests):
            req = self._requests[req_id]
            if req.state is InstanceRequestState.HANDED:
                del self._requests[req_id]  # their pages died with the ranks
        self.restarts += 1
        try:
            self._start_ranks()
            for req_id, req in list(self._requests.items()):
                self._submit(req_id, req)
        except RankFailure as exc:
            self._replace_ranks(exc)

    def _recovering(self, call: Callable[[], T], on_failure: T) -> T:
        """`call()` over the ranks, recovered like a failed step when a rank fails in it (the
        ranks replaced, every pending request added again); `on_failure` is then the answer.
        Every call a driver makes between steps goes through here or through `step_report`:
        one failed rank never reaches the caller as an exception (only InstanceError does,
        when the ranks keep failing)."""
        try:
            return call()
        except RankFailure as exc:
            self._recover(exc)
            return on_failure

    def abort(self, request_id: int) -> Output | None:
        req = self._requests.get(request_id)
        if req is None or req.state is not InstanceRequestState.PENDING:
            return None
        try:
            out = self.rank_group.abort(request_id)
        except RankFailure as exc:
            del self._requests[request_id]  # not re-added by the recovery: it is aborted
            self._recover(exc)
            return None
        if out is None:  # the ranks had finished it already; it comes out of the next step
            return None
        return self._finish(request_id, out)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams = SamplingParams(), max_steps: int = 100_000
                 ) -> list[Output]:
        """Run token prompts to completion on all ranks; rank 0's outputs in prompt order."""
        return self.wait([self.add_request(p, sampling) for p in prompts], max_steps)

    def wait(self, ids: Sequence[int], max_steps: int = 100_000) -> list[Output]:
        """Step until the requests `ids` have finished; their outputs in that order."""
        pending = set(ids) - set(self._done)
        for _ in range(max_steps):
            if not pending:
                break
            outs = self.step()
            for out in outs:
                self._done[out.request_id] = out
                pending.discard(out.request_id)
            if not outs:
                time.sleep(IDLE_WAIT_S)
        else:
            raise InstanceError(f"requests {sorted(pending)} unfinished after {max_steps} "
                                f"steps; raise max_steps")
        return [self._done.pop(i) for i in ids]

    @property
    def num_pending(self) -> int:
        return sum(req.state is InstanceRequestState.PENDING for req in self._requests.values())

    @property
    def num_submitted(self) -> int:
        """Requests added over the instance's life."""
        return self._submitted

    # ---- prefill/decode hand-offs: setup -----------------------------------------------------
    def handoff_open(self, transport: str, staged: bool = False) -> list[bytes]:
        """Every rank opens its endpoint (kept across rank restarts); their addresses.
        `staged`: the peers have another TP size (hand-offs go through L2). Setup, not
        recovered: a failure here (a bad transport) raises."""
        addresses = self.rank_group.handoff_open(transport, staged)
        self._transport = (transport, staged)
        return addresses

    # ---- decode side -------------------------------------------------------------------------
    def reserve_handoff(self, handoff_id: str, num_tokens: int,
                        hold_s: float = DEFAULT_HOLD_S, staged: bool = False
                        ) -> list[HandoffTarget] | None:
        """Bootstrap: every rank reserves L1 pages for the prompt (and L2 staging pages when
        `staged`: the prefill instance has another TP size); each rank's target, or None (and
        nothing held) when any rank has no room or a rank failed (the instance recovers)."""
        def reserve() -> list[HandoffTarget] | None:
            got = self.rank_group.handoff_reserve(handoff_id, num_tokens, hold_s, staged)
            targets = [t for t in got if t is not None]
            if len(targets) < len(got):
                self.rank_group.handoff_cancel(handoff_id)
                return None
            return targets
        return self._recovering(reserve, None)

    def cancel_handoff(self, handoff_id: str, linger_s: float = 0.0) -> None:
        """Call a reservation off on every rank: its pages are freed now, or after
        `linger_s` when a write to them failed (it may still be running). A rank that fails
        here is replaced with the others: the reservation died with them."""
        self._recovering(lambda: self.rank_group.handoff_cancel(handoff_id, linger_s), None)

    def prompt_pages_held(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Whole pages of the prompt every rank holds in L1 or L2 (0 when a rank fails: the
        instance recovers, its new ranks hold nothing)."""
        return self._recovering(
            lambda: min(self.rank_group.pin_held([int(t) for t in tokens], cache_salt)), 0)

    def add_received(self, tokens: Sequence[int], sampling: SamplingParams,
                     sent: Sequence[HandoffSent], targets: Sequence[HandoffTarget],
                     first_token: int, cache_salt: str = "",
                     first_logprob: TokenLogprob | None = None,
                     request_id: int | None = None, label: str = "") -> int:
        """Queue the decode request whose prompt KV the prefill ranks wrote into `targets`
        (this instance's ranks' reservations; `sent`: each prefill rank's transfer, with its
        sums); it decodes from `first_token` (with `first_logprob`, when it asked for them)
        on once every rank verified its pages (KV-ready), or goes on after that token with
        its prompt recomputed."""
        if len(targets) != self.size:
            raise ConfigError(f"{len(targets)} reservations for a TP={self.size} decode "
                              f"instance; give every rank's")
        incoming = tuple(IncomingKV(t.handoff_id, t.pages, rank_sums(t, sent), int(first_token),
                                    first_logprob,
                                    t.staging.pages if t.staging is not None else ())
                         for t in targets)
        return self._add(InstanceRequest(tuple(int(t) for t in tokens), sampling,
                                         check_cache_salt(cache_salt), label=label,
                                         incoming=incoming),
                         request_id)

    # ---- prefill side ------------------------------------------------------------------------
    def add_prefill(self, tokens: Sequence[int], sampling: SamplingParams,
                    targets: Sequence[HandoffTarget], cache_salt: str = "",
                    request_id: int | None = None, label: str = "") -> int:
        """Queue a prefill whose prompt KV goes to the decode ranks' `targets` once computed
        (each rank writes its KV heads to the ranks holding them; `step_report().handoffs`
        then has each rank's HandoffSent); its pages stay held until `release_handoff`."""
        return self._add(InstanceRequest(tuple(int(t) for t in tokens), sampling,
                                         check_cache_salt(cache_salt), label=label,
                                         targets=tuple(targets)),
                         request_id)

    def release_handoff(self, request_id: int) -> bool:
        """The decode side has the request's KV (or gave up on it): the prefill ranks give its
        pages to their caches. False when they hold none for it (released already, their
        hold ended, or a rank failed: the pages died with the ranks)."""
        req = self._requests.get(request_id)
        if req is None or req.state is not InstanceRequestState.HANDED:
            return False
        del self._requests[request_id]
        return self._recovering(lambda: all(self.rank_group.release_handoff(request_id)),
                                False)

    @property
    def handed_requests(self) -> int:
        """Finished prefills whose pages the ranks hold until `release_handoff`."""
        self._forget_expired()
        return sum(req.state is InstanceRequestState.HANDED for req in self._requests.values())

    def _forget_expired(self) -> None:
        """The ranks released these at their hold's end already; a release that never came
        must not keep them here."""
        now = time.monotonic()
        for req_id in [i for i, req in self._requests.items()
                       if req.state is InstanceRequestState.HANDED and req.held_until <= now]:
            del self._requests[req_id]

    def raw_handoff_writes(self, targets: Sequence[HandoffTarget],
                           through_kvtier: bool = False) -> list[tuple[int, float]]:
        """The benchmark's baseline: every rank at once makes, with the bare transport, the
        writes a hand-off to the decode ranks' `targets` makes; each rank's (bytes, seconds)."""
        return self.rank_group.handoff_raw_write(targets, through_kvtier)

    def handoff_counters(self) -> list[RankTransportCounters]:
        """Every rank's hand-off counters (transport bytes and pages, reservations, checks)."""
        return self.rank_group.handoff_counters()

    # ---- inspection and faults (tests, benchmarks) ------------------------------------------
    def stats(self) -> list[RankStats]:
        return self.rank_group.stats()

    def quiesce(self) -> None:
        """Every rank waits for its queued L1<->L2 copies and L2->L3 backups."""
        self.rank_group.quiesce()

    def evict_device(self) -> list[int]:
        """Flush L1 on every rank (pages backed up in L2 stay there); free L1 pages per rank."""
        return self.rank_group.evict_device()

    def drop_cache(self) -> list[int]:
        """Evict every unlocked L1 and L2 page on every rank (L3 is untouched)."""
        return self.rank_group.drop_cache()

    def on_rank(self, rank: int, call: Callable[[Any], Any]) -> Any:
        """One rank's answer to `call(actor)`, a remote call on its actor handle (`lambda a:
        a.audit.remote()`), waited for as the instance's own calls are: fault injection and
        per-rank cache surgery in tests and soaks, whose rank classes add the fault methods.
        The instance itself calls its ranks through `rank_group`'s typed methods."""
        return wait_ranks(call(self.ranks[rank]), self.step_timeout_s,
                          f"a call on rank {rank}", self.size)

    def describe(self) -> CacheDescription:
        return self.rank_group.describe()

    def running_config(self) -> RunningConfig:
        """Rank 0's cache config and engine choices (`Rank.running_config`)."""
        return self.rank_group.running_config()

    def cache_snapshot(self) -> list[RankSnapshot]:
        """Every rank's counters and pool use (`Rank.cache_snapshot`)."""
        return self.rank_group.cache_snapshot()

    def watch_cache(self, name: str) -> None:
        """Rank 0 records cache events, returned by `step_report` (kept across restarts)."""
        self.rank_group.watch_cache(name)
        self._watch = name

    def drain_events(self) -> bytes | None:
        """Rank 0's cache events since its last step (maintenance calls evict outside steps)."""
        return self.rank_group.drain_events() if self._watch is not None else None

    def attach_l3(self, info: NamespaceInfo, l3_actor: str | None, storage: bool = True) -> str:
        """Every rank attaches its client of the namespace `info` (kept across restarts).
        `storage` False: only the namespace actor's directory, L3 off (for `peer_open`)."""
        args = (info.to_msgpack(), l3_actor, storage)
        kinds = self.rank_group.attach_l3(*args)
        self._l3 = args
        return kinds[0]

    def detach_l3(self) -> None:
        """Every rank stops using L3, and peers with it (`peer_open` again after an attach)."""
        self.rank_group.detach_l3()
        self._l3 = self._peers = None

    def peer_open(self, holder: str, transport: str = "nixl", report_l2: bool = True,
                  incarnation: str = "") -> str:
        """Every rank lends its L2 pages to the namespace's other instances and reads theirs
        (docs/architecture.md, "Peer-to-peer L2"), as L2 holder `holder`, over a NIXL or
        Mooncake endpoint; after `attach_l3` with a namespace actor, kept across restarts.
        `report_l2`: rank 0 tells the directory what its L2 holds (off when a serve replica
        does it for the instance). `incarnation`: this start of the holder in the directory
        (tiers/l2_holders.py; the serve replica's reporter uses it too), a new one when
        empty; restarted ranks keep it. Returns it."""
        incarnation = incarnation or new_incarnation()
        self.rank_group.peer_open(holder, incarnation, transport, report_l2)
        self._peers = (holder, incarnation, transport, report_l2)
        return incarnation

    def peer_counters(self) -> list[PeerReadCounters]:
        """Each rank's reads from peers so far (PeerReader.counters)."""
        return self.rank_group.peer_counters()

    def peer_raw_read(self, tokens: Sequence[int], salt: str = "") -> list[RawPeerRead]:
        """Each rank's transport alone reading what the best peer holds of `tokens` (the
        benchmark's baseline: RankPeerLink.raw_read), every rank's timed reads starting at
        one instant RAW_READ_START_S from now, as a request's reads run on all ranks at
        once."""
        return self.rank_group.peer_raw_read(list(tokens), salt,
                                             time.time() + RAW_READ_START_S)

    def kill_rank(self, rank: int) -> None:
        """Kill one rank's process (fault injection): the next call notices and recovers."""
        self.rank_group.kill(rank)

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if self.rank_group.actors:
            try:
                self.rank_group.close(timeout_s=10.0)
            except (RankFailure, InstanceError) as exc:
                log.warning("closing the ranks: %s; killing them", exc)
            self.rank_group.kill_all()
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def __enter__(self) -> "Instance":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _labels(requests: Iterable[InstanceRequest], most: int = 8) -> str:
    """The client ids of `requests` for a log line ("" when none has one)."""
    labels = [r.label for r in requests if r.label]
    if not labels:
        return ""
    more = f" and {len(labels) - most} more" if len(labels) > most else ""
    return f" ({', '.join(labels[:most])}{more})"


def _collect_handoffs(per_rank: Sequence[StepReport], pending: set[int]
                      ) -> dict[int, list[HandoffSent]]:
    """Request id -> each rank's HandoffSent, for the pending requests this step handed
    off."""
    out: dict[int, list[HandoffSent]] = {}
    for report in per_rank:
        for req_id, sent in report.handoffs:
            if req_id in pending:
                out.setdefault(req_id, []).append(sent)
    return out


def _current_info(info: bytes, l3_actor: str | None) -> bytes:
    """The namespace's info as its actor knows it now (a restarted Mooncake master has a new
    address); the saved one when there is no actor or it does not answer."""
    if l3_actor is None:
        return info
    from kvtier.actors.l3.namespace_actor import (RAY_NAMESPACE, NamespaceClient,
                                                  NamespaceUnavailable)
    try:
        client = NamespaceClient(ray.get_actor(l3_actor, namespace=RAY_NAMESPACE))
        return client.info(NamespaceInfo.from_msgpack(info).namespace).to_msgpack()
    except (ValueError, NamespaceUnavailable, KvtierError) as exc:
        log.warning("namespace actor %s: %s; re-attaching L3 with the saved settings",
                    l3_actor, exc)
        return info
