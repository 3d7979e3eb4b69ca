"""A rank's hand-off port: the prefill/decode hand-off calls (kvtier.engine.handoff) over the
rank's engine and one transport endpoint.

`Rank` (actors/rank_actor) owns one and its remote hand-off calls delegate here. The
endpoint (NIXL or Mooncake) is opened by `open` (the rank's `handoff_open`) with this rank's
L1 pool registered; a prefill rank writes through it, a decode rank is written
into. Every rank of an instance gets the same calls in the same order; per-rank values
(a rank's reservation, its prefill rank's sums) come as that rank's argument. Records
travel as msgpack records (actors/step_wire.py), never pickles; KV bytes never travel here.
"""
from __future__ import annotations

import logging
import time
from typing import Any, NamedTuple, Sequence

from kvtier.actors.step_wire import decode_sampling
from kvtier.backends.transport_base import TransportCounters
from kvtier.engine.handoff import HandoffSent, HandoffTarget, IncomingKV, Staging
from kvtier.engine.handoff_desk import DEFAULT_HOLD_S, DeskCounters
from kvtier.engine.handoff_intake import IntakeCounters
from kvtier.engine.handoff_sender import HandoffSender
from kvtier.engine.engine import Engine
from kvtier.errors import ConfigError
from kvtier.messages import pack_record, unpack_record
from kvtier.policies import Transport

log = logging.getLogger(__name__)


class RankTransportCounters(NamedTuple):
    """One rank's hand-off counters (`Instance.handoff_counters`): totals since it started,
    and what it holds now (all 0 once every hand-off is over)."""

    desk: DeskCounters            # the decode side's reservations
    intake: IntakeCounters        # the decode side's checks of received KV
    reserved_pages: int           # L1 pages reserved for hand-offs now
    handed_requests: int          # prefill requests handed off, not released yet
    sent_unreleased: int          # of those, sent
    max_report_bytes: int         # the largest step report through Ray
    transport: Transport | None  # None: no endpoint open
    transfers: TransportCounters | None       # the endpoint's writes


class RankHandoffPort:
    """One rank's hand-off endpoint (opened on demand) and the sender that writes through it."""

    def __init__(self, engine: Engine, rank: int, size: int) -> None:
        self.engine, self.rank, self.size = engine, rank, size
        self._endpoint: Any = None
        self.sender: HandoffSender | None = None

    def open(self, transport: str, staged: bool = False) -> bytes:
        """Open this rank's endpoint (once; the same transport again is a no-op) with its L1
        pool registered; its address, which peers write to. `staged`: peers have another TP
        size, so hand-offs go through L2 in `page_head` (relaid out here if needed) and L2 is
        registered too."""
        from kvtier.backends.transport_registry import open_endpoint

        kind = Transport.parse(transport, "--pd-transport")
        if self._endpoint is not None and self._endpoint.kind is not kind:
            raise ConfigError(f"rank {self.rank} has a {self._endpoint.kind.value} "
                              f"endpoint already; one transport per instance")
        if self._endpoint is None:
            self._endpoint = open_endpoint(kind, f"kvtier-rank{self.rank}of{self.size}")
            heads = self.engine.cache.heads
            self.sender = HandoffSender(self._endpoint, self.engine.cache,
                                         (heads.start, heads.stop))
        if staged:
            self.engine.cache.use_head_major_host()
            self.sender.register_host()
        return self._endpoint.address()

    # ---- decode side -------------------------------------------------------------------------
    def reserve(self, handoff_id: str, num_tokens: int,
                hold_s: float = DEFAULT_HOLD_S, staged: bool = False) -> bytes | None:
        """Bootstrap: reserve L1 pages for a prompt (and L2 staging pages when the prefill
        instance has another TP size); this rank's HandoffTarget record, or None when there
        is no room."""
        endpoint = self._need_endpoint()
        held = self.engine.reserve_handoff(handoff_id, num_tokens, hold_s, staged)
        if held is None:
            return None
        cache = self.engine.cache
        l1, l2 = cache.exchange.l1, cache.exchange.l2
        staging = Staging(l2.addr, l2.num_pages, tuple(held.staged)) if staged else None
        return pack_record(HandoffTarget(
            handoff_id, endpoint.address(), l1.addr, l1.num_pages,
            tuple(held.pages), time.time() + hold_s / 2, (cache.heads.start, cache.heads.stop),
            staging))

    def cancel(self, handoff_id: str, linger_s: float = 0.0) -> bool:
        return self.engine.handoffs.cancel(handoff_id, linger_s)

    def add_received(self, tokens: Sequence[int], sampling: bytes, cache_salt: str,
                     incoming: bytes, request_id: int | None = None) -> int:
        """Queue a decode request over its received pages (an IncomingKV record); its id.
        Without its reservation (expired; a replaced rank) it is recomputed."""
        return self.engine.add_received([int(t) for t in tokens], decode_sampling(sampling),
                                        unpack_record(IncomingKV, incoming), cache_salt,
                                        request_id)

    # ---- prefill side ------------------------------------------------------------------------
    def add_request(self, tokens: Sequence[int], sampling: bytes,
                    cache_salt: str, targets: list[bytes],
                    request_id: int | None = None) -> int:
        """Queue a prefill request whose prompt KV goes to `targets` (every decode rank's
        HandoffTarget record) once computed; the step that finishes it sends it."""
        self._need_endpoint()
        return self.engine.add_request([int(t) for t in tokens], decode_sampling(sampling),
                                       cache_salt, handoff_to=[unpack_record(HandoffTarget, t)
                                                               for t in targets],
                                       request_id=request_id)

    def release(self, request_id: int) -> bool:
        """The decode side holds the request's KV now: its pages join this rank's cache."""
        if self.sender is not None:
            self.sender.forget(request_id)
        return self.engine.release_handoff(request_id)

    def send_new(self) -> list[tuple[int, HandoffSent]]:
        """After a step: transfer each newly handed-off request; (request id, HandoffSent)
        per request. Called with none handed off too: the sender then forgets those
        whose hold expired."""
        if self.sender is None:
            return []
        handed = [req for req, _ in self.engine.scheduler.handed.values()]
        sent = self.sender.send_new(handed)
        ids = {req.handoff_to[0].handoff_id: req.id for req in handed if req.handoff_to}
        return [(ids[s.handoff_id], s) for s in sent]

    def raw_write(self, targets: list[bytes], through_kvtier: bool = False
                  ) -> tuple[int, float]:
        """The benchmark's baseline: the transport alone makes the writes a hand-off to
        `targets` (every decode rank's HandoffTarget record) makes from this rank, from its first pages;
        (bytes, seconds). `through_kvtier`: the endpoint's checked `write`, outside a step."""
        self._need_endpoint()
        return self.sender.raw_writes([unpack_record(HandoffTarget, t) for t in targets],
                                       through_kvtier)

    def counters(self, max_report_bytes: int) -> bytes:
        """This rank's hand-off counters, a RankTransportCounters record; `max_report_bytes`:
        the rank's largest step report (through Ray)."""
        endpoint = self._endpoint
        return pack_record(RankTransportCounters(
            self.engine.handoffs.counters, self.engine.scheduler.admission.handoffs.counters,
            self.engine.handoffs.held_pages, len(self.engine.scheduler.handed),
            self.sender.unreleased if self.sender is not None else 0, max_report_bytes,
            endpoint.kind if endpoint is not None else None,
            endpoint.counters if endpoint is not None else None))

    def _need_endpoint(self) -> Any:
        if self._endpoint is None:
            raise ConfigError(f"rank {self.rank} has no hand-off endpoint; call handoff_open "
                              f"(kvtier serve --pd-transport) first")
        return self._endpoint

    def close(self) -> None:
        if self._endpoint is not None:
            self._endpoint.close()
            self._endpoint = self.sender = None
