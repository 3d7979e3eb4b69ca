"""The typed client of one rank set: a method per `Rank` remote call (actors/rank_actor.py,
its collaborators in l3/rank_link, pins, pd/rank_port), each typed with its arguments and decoded
result. Arguments and results that are records cross as msgpack (actors/step_wire.py): the
rank decodes and checks them, nothing is pickled.

A call over every rank is one `.remote()` per rank and one bounded wait over all of them (the
ranks meet in their collectives: a dead rank must not leave the driver waiting for its peers'
collective timeout). Any rank's failure raises `RankFailure` (`RankDivergence` when their
agreement saw them out of step): the `Instance` that owns the group recovers from it.

    group = RankGroup(actors, timeout_s=60.0)
    reports = group.step()            # each rank's StepReport, in rank order
    held = min(group.pin_held(tokens, salt))
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import ray
from ray.exceptions import RayActorError, RayTaskError

from kvtier.actors.pd.rank_port import RankTransportCounters
from kvtier.actors.rank_actor import CacheDescription, RankSnapshot, RankStats
from kvtier.actors.step_wire import (StepReport, decode_output, decode_pin, decode_report,
                                     encode_resume, encode_sampling)
from kvtier.engine.agreement import AgreementError
from kvtier.engine.handoff import HandoffTarget, IncomingKV
from kvtier.engine.request import Output, Resume
from kvtier.engine.retraction import RetractionCounters
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import KvtierError
from kvtier.frontend.records import RunningConfig
from kvtier.messages import pack_record, unpack_record, unpack_records
from kvtier.tiers.cache_pins import PinListing, PinOutcome, PinRefusal
from kvtier.tiers.cache_types import CacheAudit
from kvtier.tiers.peer_pages import PeerReadCounters, RawPeerRead


class InstanceError(KvtierError, RuntimeError):
    """The instance cannot go on: its ranks diverged, or kept failing after restarts."""


class RankFailure(InstanceError):
    """A rank actor died, failed a call or did not answer in time (the instance recovers)."""


class RankDivergence(RankFailure):
    """The ranks' schedulers fell out of step (their agreement saw different waiting queues,
    or they finished different requests): recovered like a fault, counted apart."""


def wait_ranks(refs: Any, timeout_s: float, what: str, size: int) -> Any:
    """Wait for `refs` (one ref or a list), failing as soon as any one fails."""
    single = not isinstance(refs, list)
    waiting = [refs] if single else list(refs)
    deadline = time.monotonic() + timeout_s
    try:
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1,
                                      timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RankFailure(f"{what} took over {timeout_s} s: a rank is stuck or the "
                                  f"cluster lacks {size} bundles' CPUs; check `ray status`")
            ray.get(ready)  # raises now if that rank failed
        return ray.get(refs)
    except RayActorError as exc:
        raise RankFailure(f"a rank actor died while {what}: {exc}") from exc
    except RayTaskError as exc:  # a collective that lost its peer lands here too
        if isinstance(exc.cause, AgreementError):
            raise RankDivergence(f"the ranks diverged while {what}: {exc.cause}") from exc
        raise RankFailure(f"a rank failed while {what}: {exc}") from exc


class RankGroup:
    """The rank actors of one rank set, in rank order, and the calls an instance makes to
    them. Per-rank results are lists in rank order; rank 0 speaks alone where noted."""

    def __init__(self, actors: Sequence[Any], timeout_s: float) -> None:
        """`timeout_s`: how long a call waits for every rank (a step's bound)."""
        self.actors = list(actors)
        self.timeout_s = timeout_s

    @property
    def size(self) -> int:
        return len(self.actors)

    def _wait(self, refs: Any, what: str, timeout_s: float | None = None) -> Any:
        return wait_ranks(refs, timeout_s or self.timeout_s, what, self.size)

    def _check_each(self, per_rank: Sequence[Any], what: str) -> None:
        if len(per_rank) != self.size:
            raise InstanceError(f"{what}: {len(per_rank)} ranks' arguments for {self.size} "
                                f"ranks")

    # ---- lifetime ----------------------------------------------------------------------------
    def has_unfinished(self, timeout_s: float) -> list[bool]:
        """Every rank answers (started: its model loaded and its TP group joined)."""
        return self._wait([a.has_unfinished.remote() for a in self.actors],
                          "starting the rank actors", timeout_s)

    def close(self, timeout_s: float) -> None:
        self._wait([a.close.remote() for a in self.actors], "calling close", timeout_s)

    def kill(self, rank: int) -> None:
        """Kill one rank's process (fault injection): the next call notices."""
        ray.kill(self.actors[rank], no_restart=True)

    def kill_all(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []

    # ---- the request stream -----------------------------------------------------------------
    def add_request(self, request_id: int, tokens: list[int], sampling: SamplingParams,
                    cache_salt: str, resume: Resume | None) -> list[int]:
        """Queue request `request_id` on every rank (`resume`: the answer it goes on after);
        the id each rank gave it (the same, unless their streams diverged)."""
        params, got = encode_sampling(sampling), encode_resume(resume)
        return self._wait([a.add_request.remote(tokens, params, cache_salt, got, request_id)
                           for a in self.actors], "calling add_request")

    def add_handoff_request(self, request_id: int, tokens: list[int], sampling: SamplingParams,
                            cache_salt: str, targets: Sequence[HandoffTarget]) -> list[int]:
        """A prefill whose KV goes to the decode ranks' `targets` (every rank gets them all
        and writes its KV heads to those holding them)."""
        params, wire = encode_sampling(sampling), [pack_record(t) for t in targets]
        return self._wait([a.add_handoff_request.remote(tokens, params, cache_salt, wire,
                                                        request_id)
                           for a in self.actors], "calling add_handoff_request")

    def add_received(self, request_id: int, tokens: list[int], sampling: SamplingParams,
                     cache_salt: str, incoming: Sequence[IncomingKV]) -> list[int]:
        """A decode request over the pages `incoming[r]` describes on rank r."""
        self._check_each(incoming, "add_received")
        params = encode_sampling(sampling)
        return self._wait([a.add_received.remote(tokens, params, cache_salt, pack_record(kv),
                                                 request_id)
                           for a, kv in zip(self.actors, incoming)], "calling add_received")

    def step(self) -> list[StepReport]:
        """One lockstep step; each rank's report."""
        raw = self._wait([a.step.remote() for a in self.actors], "calling step")
        return [decode_report(data) for data in raw]

    def abort(self, request_id: int) -> Output | None:
        """Rank 0's output so far of the aborted request (None: unknown to it, or done)."""
        raw = self._wait([a.abort.remote(request_id) for a in self.actors], "calling abort")
        return decode_output(raw[0])

    # ---- rank 0 alone ------------------------------------------------------------------------
    def _first(self, ref: Any, what: str) -> Any:
        return self._wait(ref, f"calling {what} on rank 0")

    def watch_cache(self, name: str) -> None:
        self._first(self.actors[0].watch_cache.remote(name), "watch_cache")

    def drain_events(self) -> bytes | None:
        return self._first(self.actors[0].drain_events.remote(), "drain_events")

    def describe(self) -> CacheDescription:
        return unpack_record(CacheDescription,
                             self._first(self.actors[0].describe.remote(), "describe"))

    def running_config(self) -> RunningConfig:
        return unpack_record(RunningConfig, self._first(self.actors[0].running_config.remote(),
                                                        "running_config"))

    # ---- maintenance and inspection ----------------------------------------------------------
    def attach_l3(self, info: bytes, l3_actor: str | None, storage: bool = True) -> list[str]:
        """Each rank's L3 backend kind."""
        return self._wait([a.attach_l3.remote(info, l3_actor, storage) for a in self.actors],
                          "calling attach_l3")

    def detach_l3(self) -> None:
        self._wait([a.detach_l3.remote() for a in self.actors], "calling detach_l3")

    def peer_open(self, holder: str, incarnation: str, transport: str, report_l2: bool
                  ) -> None:
        self._wait([a.peer_open.remote(holder, incarnation, transport, report_l2)
                    for a in self.actors], "calling peer_open")

    def peer_counters(self) -> list[PeerReadCounters]:
        raw = self._wait([a.peer_counters.remote() for a in self.actors], "calling peer_counters")
        return [unpack_record(PeerReadCounters, data) for data in raw]

    def peer_raw_read(self, tokens: list[int], salt: str, start_at: float
                      ) -> list[RawPeerRead]:
        raw = self._wait([a.peer_raw_read.remote(tokens, salt, start_at) for a in self.actors],
                         "calling peer_raw_read")
        return [unpack_record(RawPeerRead, data) for data in raw]

    def stats(self) -> list[RankStats]:
        raw = self._wait([a.stats.remote() for a in self.actors], "calling stats")
        return [unpack_record(RankStats, data) for data in raw]

    def quiesce(self) -> None:
        self._wait([a.quiesce.remote() for a in self.actors], "calling quiesce")

    def evict_device(self) -> list[int]:
        """Each rank's free L1 pages after."""
        return self._wait([a.evict_device.remote() for a in self.actors],
                          "calling evict_device")

    def drop_cache(self) -> list[int]:
        """Each rank's free L1 pages after."""
        return self._wait([a.drop_cache.remote() for a in self.actors], "calling drop_cache")

    def cache_snapshot(self) -> list[RankSnapshot]:
        raw = self._wait([a.cache_snapshot.remote() for a in self.actors],
                         "calling cache_snapshot")
        return [unpack_record(RankSnapshot, data) for data in raw]

    def audit(self) -> list[CacheAudit]:
        """Each rank's pages outside its tree (all zero: nothing leaked)."""
        return [unpack_record(CacheAudit, b) for b in
                self._wait([a.audit.remote() for a in self.actors], "calling audit")]

    def retraction_counters(self) -> list[RetractionCounters]:
        return [unpack_record(RetractionCounters, b) for b in
                self._wait([a.retraction_counters.remote() for a in self.actors],
                           "calling retraction_counters")]

    # ---- pins --------------------------------------------------------------------------------
    def pin_held(self, tokens: list[int], salt: str) -> list[int]:
        """Whole pages of `tokens` each rank holds in L1 or L2."""
        return self._wait([a.pin_held.remote(tokens, salt) for a in self.actors],
                          "calling pin_held")

    def pin(self, pin_id: str, tokens: list[int], pages: int, ttl_s: float, max_fraction: float,
            salt: str, tenant: str) -> list[PinOutcome | PinRefusal]:
        raw = self._wait([a.pin.remote(pin_id, tokens, pages, ttl_s, max_fraction, salt, tenant)
                          for a in self.actors], "calling pin")
        return [decode_pin(out) for out in raw]

    def unpin(self, pin_id: str) -> list[bool]:
        return self._wait([a.unpin.remote(pin_id) for a in self.actors], "calling unpin")

    def pins(self) -> list[list[PinListing]]:
        """Each rank's live pins."""
        return [unpack_records(PinListing, b) for b in
                self._wait([a.pins.remote() for a in self.actors], "calling pins")]

    # ---- prefill/decode hand-offs ------------------------------------------------------------
    def handoff_open(self, transport: str, staged: bool) -> list[bytes]:
        """Each rank's endpoint address."""
        return self._wait([a.handoff_open.remote(transport, staged) for a in self.actors],
                          "calling handoff_open")

    def handoff_reserve(self, handoff_id: str, num_tokens: int, hold_s: float, staged: bool
                        ) -> list[HandoffTarget | None]:
        """Each rank's reservation (None: that rank has no room)."""
        raw = self._wait([a.handoff_reserve.remote(handoff_id, num_tokens, hold_s, staged)
                          for a in self.actors], "calling handoff_reserve")
        return [None if t is None else unpack_record(HandoffTarget, t) for t in raw]

    def handoff_cancel(self, handoff_id: str, linger_s: float = 0.0) -> list[bool]:
        return self._wait([a.handoff_cancel.remote(handoff_id, linger_s) for a in self.actors],
                          "calling handoff_cancel")

    def release_handoff(self, request_id: int) -> list[bool]:
        return self._wait([a.release_handoff.remote(request_id) for a in self.actors],
                          "calling release_handoff")

    def handoff_raw_write(self, targets: Sequence[HandoffTarget], through_kvtier: bool
                          ) -> list[tuple[int, float]]:
        """Each rank's (bytes, seconds) for the bare transport's writes to `targets`."""
        wire = [pack_record(t) for t in targets]
        return self._wait([a.handoff_raw_write.remote(wire, through_kvtier)
                           for a in self.actors], "calling handoff_raw_write")

    def handoff_counters(self) -> list[RankTransportCounters]:
        return [unpack_record(RankTransportCounters, b) for b in
                self._wait([a.handoff_counters.remote() for a in self.actors],
                           "calling handoff_counters")]
