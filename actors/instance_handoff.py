"""The prefill/decode hand-off calls of an Instance (over its ranks' hand-off port,
actors/rank_handoff).

A base of `Instance`, apart so the instance's module keeps to its noun. Rank r of a prefill
instance writes into rank r of its decode instance (equal TP sizes: each rank holds the same
KV heads on both sides), so every per-rank value is a list in rank order.

    decode.handoff_open("nixl"); prefill.handoff_open("nixl")
    targets = decode.reserve_handoff("req-1", len(prompt))      # bootstrap (None: no room)
    pid = prefill.add_prefill(prompt, SamplingParams(max_new_tokens=1), targets)
    ... prefill.step_report().handoffs[pid]                      # each rank's HandoffSent
    did = decode.add_received(prompt, sampling, incoming_kv(...))  # KV-ready, then decode
    prefill.release_handoff(pid)                                 # once the decode side has it

Every call recovers the instance when a rank fails in it, as a step does (`_recovering`: the
ranks replaced, pending requests added again): what the failed ranks held died with them (a
reservation, handed-off pages), and the call answers as if it were gone (None, False).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, NamedTuple, Sequence, TypeVar

from kvtier.engine.handoff import HandoffSent, HandoffTarget, IncomingKV, rank_sums
from kvtier.engine.handoff_desk import DEFAULT_HOLD_S
from kvtier.engine.request import FinishReason, Resume
from kvtier.engine.sampling import SamplingParams, TokenLogprob
from kvtier.engine.scheduler import HANDED_HOLD_S
from kvtier.errors import ConfigError
from kvtier.keys import check_cache_salt

if TYPE_CHECKING:
    from kvtier.actors.step_wire import Progress, StepReport

T = TypeVar("T")


@dataclass
class PendingRequest:
    """A request the instance has not returned yet: enough to run it again (a prefill again
    to the same decode pages; a decode request over its pages, which a replaced rank no
    longer has: it is then recomputed), and the answer so far, which a run again goes on
    after (`resume`)."""

    tokens: tuple[int, ...]
    sampling: SamplingParams
    cache_salt: str = ""
    targets: tuple[list, ...] | None = None  # prefill side: each rank's HandoffTarget (wire)
    incoming: tuple[list, ...] | None = None  # decode side: each rank's IncomingKV (wire)
    answer: list[int] = field(default_factory=list)  # tokens returned so far (progress)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # theirs, when it asked

    def resume(self) -> Resume | None:
        """What a run again goes on after (None: nothing returned yet)."""
        if not self.answer:
            return None
        logprobs = tuple(self.logprobs) if self.sampling.logprobs is not None else None
        return Resume(tuple(self.answer), logprobs)

    def take(self, progress: "Progress") -> "Progress | None":
        """Keep what `progress` adds to the answer; that part (None: nothing new)."""
        new = progress.after(len(self.answer))
        if new is None:
            return None
        assert new.start == len(self.answer), "a step skipped answer tokens"
        self.answer += new.tokens
        if new.logprobs is not None:
            self.logprobs += new.logprobs
        return new


class Handed(NamedTuple):
    """A finished prefill whose pages its ranks hold for the decode side."""

    rank_id: int     # its id on the current ranks
    deadline: float  # monotonic: the ranks have given the pages back by then (their hold)


class InstanceHandoff:
    """Hand-off calls over `self.ranks` (`_all`, `_each`, `_add`, `_recovering` come from
    Instance)."""

    size: int
    _transport: tuple[str, bool] | None
    _handed: dict[int, Handed]
    _instance_id: dict[int, int]
    handed_hold_s = HANDED_HOLD_S  # how long the ranks hold a handed-off request's pages

    def handoff_open(self, transport: str, staged: bool = False) -> list[bytes]:
        """Every rank opens its endpoint (kept across rank restarts); their addresses.
        `staged`: the peers have another TP size (hand-offs go through L2). Setup, not
        recovered: a failure here (a bad transport) raises."""
        addresses = self._all("handoff_open", transport, staged)
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
            got = self._all("handoff_reserve", handoff_id, num_tokens, hold_s, staged)
            if any(t is None for t in got):
                self._all("handoff_cancel", handoff_id)
                return None
            return [HandoffTarget.from_wire(t) for t in got]
        return self._recovering(reserve, None)

    def cancel_handoff(self, handoff_id: str, linger_s: float = 0.0) -> None:
        """Call a reservation off on every rank: its pages are freed now, or after
        `linger_s` when a write to them failed (it may still be running). A rank that fails
        here is replaced with the others: the reservation died with them."""
        self._recovering(lambda: self._all("handoff_cancel", handoff_id, linger_s), None)

    def prompt_pages_held(self, tokens: Sequence[int], cache_salt: str = "") -> int:
        """Whole pages of the prompt every rank holds in L1 or L2 (0 when a rank fails: the
        instance recovers, its new ranks hold nothing)."""
        return self._recovering(
            lambda: min(self._all("pin_held", [int(t) for t in tokens], cache_salt)), 0)

    def add_received(self, tokens: Sequence[int], sampling: SamplingParams,
                     sent: Sequence[HandoffSent], targets: Sequence[HandoffTarget],
                     first_token: int, cache_salt: str = "",
                     first_logprob: TokenLogprob | None = None) -> int:
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
                                    t.staging.pages if t.staging is not None else ()).to_wire()
                         for t in targets)
        return self._add(PendingRequest(tuple(int(t) for t in tokens), sampling,
                                              check_cache_salt(cache_salt), None, incoming))

    # ---- prefill side ------------------------------------------------------------------------
    def add_prefill(self, tokens: Sequence[int], sampling: SamplingParams,
                    targets: Sequence[HandoffTarget], cache_salt: str = "") -> int:
        """Queue a prefill whose prompt KV goes to the decode ranks' `targets` once computed
        (each rank writes its KV heads to the ranks holding them; `step_report().handoffs`
        then has each rank's HandoffSent); its pages stay held until `release_handoff`."""
        wire = [t.to_wire() for t in targets]
        return self._add(PendingRequest(tuple(int(t) for t in tokens), sampling,
                                        check_cache_salt(cache_salt),
                                        tuple(wire for _ in range(self.size))))

    def release_handoff(self, request_id: int) -> bool:
        """The decode side has the request's KV (or gave up on it): the prefill ranks give its
        pages to their caches. False when they hold none for it (released already, their
        hold ended, or a rank failed: the pages died with the ranks)."""
        held = self._handed.pop(request_id, None)
        if held is None:
            return False
        return self._recovering(lambda: all(self._all("release_handoff", held.rank_id)), False)

    @property
    def handed_requests(self) -> int:
        """Finished prefills whose pages the ranks hold until `release_handoff`."""
        self._forget_expired()
        return len(self._handed)

    def _hand(self, request_id: int, rank_id: int, reason: FinishReason) -> None:
        """A prefill finished: its ranks hold its pages for the decode side unless it was
        aborted (as their scheduler does); remembered until released or their hold ends."""
        self._forget_expired()
        if reason is not FinishReason.ABORTED:
            self._handed[request_id] = Handed(rank_id, time.monotonic() + self.handed_hold_s)

    def _forget_expired(self) -> None:
        """The ranks released these at their hold's end already; a release that never came
        must not keep them here."""
        now = time.monotonic()
        for req_id in [i for i, h in self._handed.items() if h.deadline <= now]:
            del self._handed[req_id]

    def raw_handoff_writes(self, targets: Sequence[HandoffTarget],
                           through_kvtier: bool = False) -> list[tuple[int, float]]:
        """The benchmark's baseline: every rank at once makes, with the bare transport, the
        writes a hand-off to the decode ranks' `targets` makes; each rank's (bytes, seconds)."""
        wire = [t.to_wire() for t in targets]
        return self._all("handoff_raw_write", wire, through_kvtier)

    def handoff_counters(self) -> list[dict]:
        """Every rank's hand-off counters (transport bytes and pages, reservations, checks)."""
        return self._all("handoff_counters")

    def _collect_handoffs(self, per_rank: Sequence["StepReport"]) -> dict[int, list[HandoffSent]]:
        """id -> each rank's HandoffSent, for the requests this step handed off."""
        out: dict[int, list[HandoffSent]] = {}
        for report in per_rank:
            for rank_id, wire in report.handoffs:
                req_id = self._instance_id.get(rank_id)
                if req_id is not None:
                    out.setdefault(req_id, []).append(HandoffSent.from_wire(wire))
        return out

    # provided by Instance
    def _all(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        raise NotImplementedError

    def _add(self, pending: Any) -> int:
        raise NotImplementedError

    def _recovering(self, call: Callable[[], T], on_failure: T) -> T:
        raise NotImplementedError


