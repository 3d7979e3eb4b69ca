"""An Instance: the TP rank actors of one model replica, stepped in lockstep.

The ranks sit in one placement group (PACK: on one node when it fits). Every request goes to
every rank in the same order; each step is one `.remote()` per rank and one bounded `ray.get`
over all of them (the ranks meet in their collectives: the agreement round and the model's
all-reduces). Ranks must produce the same outputs; rank 0's are returned.

    with local_ray(2), Instance(RankSettings(TinyWeights(), HiCacheConfig(page_size=16)),
                                tp_size=2) as inst:
        outs = inst.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
"""
from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, NamedTuple, Sequence, TypeVar

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group

from kvtier.actors.cluster_placement import unplaced_message
from kvtier.actors.instance_handoff import Handed, InstanceHandoff, PendingRequest
from kvtier.actors.rank_actor import (RANK_NUM_CPUS, CacheDescription, Rank, RankSettings,
                                      RankStats, create_rank_actor)
from kvtier.actors.step_wire import Progress, decode_output, decode_report, resume_to_wire
from kvtier.engine.agreement import AgreementError
from kvtier.engine.handoff import HandoffSent
from kvtier.engine.request import Output, Resume
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.tp_group import loopback_init_method
from kvtier.errors import ConfigError, KvtierError, PlacementError
from kvtier.keys import check_cache_salt
from kvtier.messages import NamespaceInfo
from kvtier.serve.placement import rank_bundle

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 60.0
MAX_RESTARTS = 3  # rank-set replacements in a row without a completed step
IDLE_WAIT_S = 0.0005

T = TypeVar("T")


class InstanceError(KvtierError, RuntimeError):
    """The instance cannot go on: its ranks diverged, or kept failing after restarts."""


class RankFailure(InstanceError):
    """A rank actor died, failed a call or did not answer in time (the instance recovers)."""


class RankDivergence(RankFailure):
    """The ranks' schedulers fell out of step (their agreement saw different waiting queues,
    or they finished different requests): recovered like a fault, counted apart."""


class InstanceStep(NamedTuple):
    finished: list[Output]  # by instance request id
    progress: dict[int, Progress]  # running requests whose answer grew: the new tokens
    events: bytes | None  # rank 0's CacheEventBatch (msgpack), when watching
    handoffs: dict[int, list[HandoffSent]] = {}  # prefill side: id -> each rank's transfer


class Instance(InstanceHandoff):
    """`tp_size` Rank actors over one request stream; `generate` or `add_request`+`step`.

    Faults: when a rank dies, hangs past `step_timeout_s` or fails a call, the TP group is
    broken for every rank (a collective cannot re-admit one member), so the instance kills
    all its ranks, starts a fresh set in the same placement-group bundles, and adds every
    request it has not returned yet again: each goes on after the answer tokens it already
    returned (their KV and the prompt's recomputed, hitting L3 where the namespace has their
    pages; in deterministic mode the answer is recomputed from the prompt and must repeat
    them), so none is lost and no answer is spliced from two runs. Request ids are the
    instance's own and survive a restart. After `max_restarts` restarts in a row
    with no step completed between them, the instance gives up with an InstanceError.
    """

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
        self.restarts = 0  # rank sets replaced after a fault, over the instance's life
        self.recovering = False  # replacing its ranks now (read by other threads: a poll)
        self.divergences = 0  # of those, the ones caused by ranks out of step
        self._failures_in_a_row = 0
        self._next_id = 0
        self._pending: dict[int, PendingRequest] = {}  # instance id -> request, in arrival order
        self._rank_id: dict[int, int] = {}  # instance id -> the current ranks' request id
        self._instance_id: dict[int, int] = {}  # the reverse
        self._done: dict[int, Output] = {}
        self.call_s = 0.0  # driver time inside step calls (for the actor-call overhead)
        self._l3: tuple[bytes, str | None] | None = None  # what attach_l3 was given
        self._watch: str | None = None  # the name watch_cache was given
        self._transport: tuple[str, bool] | None = None  # what handoff_open was given
        self._handed: dict[int, Handed] = {}  # prefill side: instance id -> held pages
        bundle = rank_bundle(num_cpus_per_rank, int(settings.gpu), resources)
        self._pg = placement_group([dict(bundle) for _ in range(tp_size)], strategy=strategy)
        self.ranks: list[Any] = []
        try:
            self._wait_placed(bundle, strategy)
            self._start_ranks()
        except BaseException:
            self.close()
            raise
        log.info("instance ready: TP=%d (%s)", tp_size, strategy)

    def _wait_placed(self, bundle: dict[str, float], strategy: str) -> None:
        """Wait for the placement group; a PlacementError naming the nodes that offer what
        the bundles ask for if Ray cannot place it within ready_timeout_s."""
        ready, _ = ray.wait([self._pg.ready()], timeout=self.ready_timeout_s)
        if not ready:
            raise PlacementError(unplaced_message(bundle, self.size, strategy,
                                                  self.ready_timeout_s))
        ray.get(ready[0])

    def _start_ranks(self) -> None:
        init_method = loopback_init_method()
        s = self._settings
        if s.l3 is not None:  # the namespace as it is now (a restarted master moved it)
            info = _current_info(s.l3.to_msgpack(), s.l3_actor)
            self._settings = s = s._replace(l3=NamespaceInfo.from_msgpack(info))
        self.ranks = [create_rank_actor(r, self.size, init_method, s, self._pg,
                                        self._num_cpus, self._rank_class)
                      for r in range(self.size)]
        self._get([a.has_unfinished.remote() for a in self.ranks], self.ready_timeout_s,
                  "starting the rank actors")
        if self._l3 is not None:  # a replacement set gets the namespace as it is now
            self._all("attach_l3", _current_info(*self._l3), self._l3[1])
        if self._watch is not None:
            self.rank_call(0, "watch_cache", self._watch)
        if self._transport is not None:
            self._all("handoff_open", *self._transport)

    def _get(self, refs: Any, timeout_s: float, what: str) -> Any:
        """Wait for `refs`, failing as soon as any one fails (a dead rank must not leave the
        driver waiting for its peers' collective timeout)."""
        single = not isinstance(refs, list)
        waiting = [refs] if single else list(refs)
        deadline = time.monotonic() + timeout_s
        try:
            while waiting:
                ready, waiting = ray.wait(waiting, num_returns=1,
                                          timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise RankFailure(f"{what} took over {timeout_s} s: a rank is stuck or "
                                      f"the cluster lacks {self.size} bundles' CPUs; check "
                                      f"`ray status`")
                ray.get(ready)  # raises now if that rank failed
            return ray.get(refs)
        except RayActorError as exc:
            raise RankFailure(f"a rank actor died while {what}: {exc}") from exc
        except RayTaskError as exc:  # a collective that lost its peer lands here too
            if isinstance(exc.cause, AgreementError):
                raise RankDivergence(f"the ranks diverged while {what}: {exc.cause}") from exc
            raise RankFailure(f"a rank failed while {what}: {exc}") from exc

    def _all(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        refs = [getattr(a, method).remote(*args) for a in self.ranks]
        return self._get(refs, timeout_s or self.step_timeout_s, f"calling {method}")

    def _each(self, method: str, per_rank: Sequence[Sequence[Any]]) -> list[Any]:
        """Call every rank with its own arguments (`per_rank[r]` for rank r)."""
        if len(per_rank) != self.size:
            raise InstanceError(f"{method}: {len(per_rank)} ranks' arguments for {self.size} "
                                f"ranks")
        refs = [getattr(a, method).remote(*args) for a, args in zip(self.ranks, per_rank)]
        return self._get(refs, self.step_timeout_s, f"calling {method}")

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, tokens: Sequence[int], sampling: SamplingParams = SamplingParams(),
                    cache_salt: str = "", resume: Resume | None = None) -> int:
        """Queue a request on every rank; its id (the instance's, stable across restarts).
        `cache_salt`: its tenant (it hits only prefixes cached with the same salt).
        `resume`: the start of its answer the caller has already (it ran elsewhere): it goes
        on after those tokens, which its progress never reports again."""
        pending = PendingRequest(tuple(int(t) for t in tokens), sampling,
                                 check_cache_salt(cache_salt))
        if resume is not None:
            pending.answer, pending.logprobs = list(resume.tokens), list(resume.logprobs or ())
        return self._add(pending)

    def _add(self, pending: PendingRequest) -> int:
        req_id, self._next_id = self._next_id, self._next_id + 1
        self._pending[req_id] = pending
        try:
            self._submit(req_id)
        except RankFailure as exc:
            self._recover(exc)  # re-adds every pending request, this one too
        return req_id

    def _submit(self, req_id: int) -> None:
        """Queue pending request `req_id` on every rank: new, or again after a restart, when
        it goes on after the answer it has (its hand-off pages died with the old ranks)."""
        req = self._pending[req_id]
        args = (list(req.tokens), req.sampling, req.cache_salt)
        if req.targets is not None:
            ids = self._each("add_handoff_request", [(*args, t) for t in req.targets])
        elif req.incoming is not None and not req.answer:
            ids = self._each("add_received", [(*args, kv) for kv in req.incoming])
        else:
            ids = self._all("add_request", *args, resume_to_wire(req.resume()))
        if len(set(ids)) != 1:
            raise RankDivergence(f"ranks gave request ids {ids}: their streams are out of "
                                 f"step")  # recovered like any divergence
        self._rank_id[req_id], self._instance_id[ids[0]] = ids[0], req_id

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
            per_rank = self._all("step")
        except RankFailure as exc:
            self._recover(exc)
            return InstanceStep([], {}, None)
        finally:
            self.call_s += time.perf_counter() - start
        per_rank = [decode_report(data) for data in per_rank]
        first = per_rank[0]
        for rank, report in enumerate(per_rank[1:], start=1):
            got = [(o.request_id, o.tokens, o.finish_reason) for o in report.finished]
            want = [(o.request_id, o.tokens, o.finish_reason) for o in first.finished]
            if got != want:  # nothing of this step is returned: every request recomputes
                self._recover(RankDivergence(f"rank {rank} finished {got} but rank 0 {want}"))
                return InstanceStep([], {}, None)
        self._failures_in_a_row = 0
        progress = {}
        for rank_id, got in first.progress.items():
            req_id = self._instance_id.get(rank_id)
            new = None if req_id is None else self._pending[req_id].take(got)
            if new is not None:
                progress[req_id] = new
        handoffs = self._collect_handoffs(per_rank)
        return InstanceStep([self._finish(o) for o in first.finished], progress, first.events,
                            handoffs)

    def _finish(self, out: Output) -> Output:
        req_id = self._instance_id.pop(out.request_id)
        if self._pending[req_id].targets is not None:  # its pages wait for release_handoff
            self._hand(req_id, self._rank_id[req_id], out.finish_reason)
        del self._rank_id[req_id], self._pending[req_id]
        return dataclasses.replace(out, request_id=req_id)

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
        log.warning("%s; replacing all %d ranks and recomputing %d pending requests",
                    cause, self.size, len(self._pending))
        self.divergences += isinstance(cause, RankDivergence)
        self._kill_ranks()
        self._rank_id.clear()
        self._instance_id.clear()
        self._handed.clear()  # their pages died with the ranks
        self.restarts += 1
        try:
            self._start_ranks()
            for req_id in list(self._pending):
                self._submit(req_id)
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
        if request_id not in self._pending:
            return None
        try:
            out = decode_output(self._all("abort", self._rank_id[request_id])[0])
        except RankFailure as exc:
            del self._pending[request_id]  # not re-added by the recovery: it is aborted
            self._recover(exc)
            return None
        if out is None:  # the ranks had finished it already; it comes out of the next step
            return None
        return self._finish(out)

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
        return len(self._pending)

    @property
    def num_submitted(self) -> int:
        """Requests added over the instance's life."""
        return self._next_id

    # ---- inspection and faults (tests, benchmarks) ------------------------------------------
    def stats(self) -> list[RankStats]:
        return self._all("stats")

    def quiesce(self) -> None:
        """Every rank waits for its queued L1<->L2 copies and L2->L3 backups."""
        self._all("quiesce")

    def evict_device(self) -> list[int]:
        """Flush L1 on every rank (pages backed up in L2 stay there); free L1 pages per rank."""
        return self._all("evict_device")

    def drop_cache(self) -> list[int]:
        """Evict every unlocked L1 and L2 page on every rank (L3 is untouched)."""
        return self._all("drop_cache")

    def call_all(self, method: str, *args: Any) -> list[Any]:
        """Call every rank in one lockstep round (maintenance between steps); results in
        rank order."""
        return self._all(method, *args)

    def rank_call(self, rank: int, method: str, *args: Any) -> Any:
        """Call one rank only (fault injection, per-rank cache surgery in tests)."""
        return self._get(getattr(self.ranks[rank], method).remote(*args), self.step_timeout_s,
                         f"calling {method} on rank {rank}")

    def describe(self) -> CacheDescription:
        return self.rank_call(0, "describe")

    def running_config(self) -> dict:
        """Rank 0's cache config and engine choices (`Rank.running_config`)."""
        return self.rank_call(0, "running_config")

    def cache_snapshot(self) -> list[dict]:
        """Every rank's counters and pool use (`Rank.cache_snapshot`)."""
        return self._all("cache_snapshot")

    def watch_cache(self, name: str) -> None:
        """Rank 0 records cache events, returned by `step_report` (kept across restarts)."""
        self.rank_call(0, "watch_cache", name)
        self._watch = name

    def drain_events(self) -> bytes | None:
        """Rank 0's cache events since its last step (maintenance calls evict outside steps)."""
        return self.rank_call(0, "drain_events") if self._watch is not None else None

    def attach_l3(self, info: NamespaceInfo, l3_actor: str | None) -> str:
        """Every rank attaches its client of the namespace `info` (kept across restarts)."""
        args = (info.to_msgpack(), l3_actor)
        kinds = self._all("attach_l3", *args)
        self._l3 = args
        return kinds[0]

    def detach_l3(self) -> None:
        self._all("detach_l3")
        self._l3 = None

    def kill_rank(self, rank: int) -> None:
        """Kill one rank's process (fault injection): the next call notices and recovers."""
        ray.kill(self.ranks[rank], no_restart=True)

    # ---- lifetime --------------------------------------------------------------------------
    def _kill_ranks(self) -> None:
        for actor in self.ranks:
            ray.kill(actor, no_restart=True)
        self.ranks = []

    def close(self) -> None:
        if self.ranks:
            try:
                self._all("close", timeout_s=10.0)
            except (RankFailure, InstanceError) as exc:
                log.warning("closing the ranks: %s; killing them", exc)
            self._kill_ranks()
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def __enter__(self) -> "Instance":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _current_info(info: bytes, l3_actor: str | None) -> bytes:
    """The namespace's info as its actor knows it now (a restarted Mooncake master has a new
    address); the saved one when there is no actor or it does not answer."""
    if l3_actor is None:
        return info
    from kvtier.actors.namespace_actor import RAY_NAMESPACE, NamespaceClient, NamespaceUnavailable
    try:
        client = NamespaceClient(ray.get_actor(l3_actor, namespace=RAY_NAMESPACE))
        return client.info(NamespaceInfo.from_msgpack(info).namespace).to_msgpack()
    except (ValueError, NamespaceUnavailable, KvtierError) as exc:
        log.warning("namespace actor %s: %s; re-attaching L3 with the saved settings",
                    l3_actor, exc)
        return info
