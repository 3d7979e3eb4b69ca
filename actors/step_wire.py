"""What crosses the boundary between an instance and its rank actors, as msgpack records of
kvtier.messages (one convention: a map per record with its `type` tag and named fields,
every field checked against its type hint when decoded; docs/architecture.md invariant 10:
actors exchange msgpack, never pickles).

Why not let Ray pickle the arguments and results: a pickle runs code when it is loaded and
ties both sides to one class layout; these are plain values, checked when decoded, so a
payload from a peer of another version fails with a clear `MessageError`. The prefill logits
stay behind (`Output.prefill_logits` is not a wire field: a vocabulary of floats per request
that nothing past the rank needs).

Going to the ranks: `SamplingParams`, `Resume`, `HandoffTarget`, `IncomingKV` (each
`pack_record` bytes). Coming back: a `StepReport` per rank per step, an `Output` from an
abort, a `HandoffTarget` from a reservation.
"""
from __future__ import annotations

from typing import NamedTuple

import msgpack

from kvtier.engine.handoff import HandoffSent
from kvtier.engine.request import Output, Resume
from kvtier.engine.sampling import SamplingParams, TokenLogprob
from kvtier.messages import (pack_record, record_from_map, record_to_map, unpack_payload,
                             unpack_record)
from kvtier.tiers.cache_pins import PinOutcome, PinRefusal


class Progress(NamedTuple):
    """A running request's new answer tokens: those from index `start` of its answer on (rank
    0 reports each token once, in the step that chose it: a step's report does not grow with
    the answer)."""

    start: int
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when it asked

    @property
    def stop(self) -> int:
        """The answer's index after these tokens."""
        return self.start + len(self.tokens)

    def after(self, have: int) -> "Progress | None":
        """The part from answer index `have` on (None: nothing new); a caller that has the
        first `have` tokens passes on only this."""
        if self.stop <= have:
            return None
        skip = max(0, have - self.start)
        lps = None if self.logprobs is None else self.logprobs[skip:]
        return Progress(self.start + skip, self.tokens[skip:], lps)


class StepReport(NamedTuple):
    """One rank's step, one msgpack payload (`encode_report`)."""

    finished: tuple[Output, ...]  # requests that finished in the step (prefill logits dropped)
    progress: dict[int, Progress]  # rank 0: request id -> its output so far, changed ones
    events: bytes | None  # rank 0: a CacheEventBatch (msgpack) when watching, else None
    handoffs: tuple[tuple[int, HandoffSent], ...] = ()  # (request id, what this rank's
    # transfer did) per request this rank handed off


def encode_report(report: StepReport) -> bytes:
    return pack_record(report)


def decode_report(data: bytes) -> StepReport:
    return unpack_record(StepReport, data)


def encode_output(out: Output | None) -> bytes:
    """An abort's answer so far (nil: the request was unknown or done)."""
    return msgpack.packb(None if out is None else record_to_map(out), use_bin_type=True)


def decode_output(data: bytes) -> Output | None:
    m = unpack_payload("Output", data)
    return None if m is None else record_from_map(Output, m)


def encode_sampling(sampling: SamplingParams) -> bytes:
    return pack_record(sampling)


def decode_sampling(data: bytes) -> SamplingParams:
    return unpack_record(SamplingParams, data)


def encode_resume(resume: Resume | None) -> bytes | None:
    return None if resume is None else pack_record(resume)


def decode_resume(data: bytes | None) -> Resume | None:
    return None if data is None else unpack_record(Resume, data)


def decode_pin(data: bytes) -> PinOutcome | PinRefusal:
    """A rank's answer to a pin: a PinOutcome or a PinRefusal record (its `type` says)."""
    m = unpack_payload("PinOutcome", data)
    kind = m.get("type") if isinstance(m, dict) else None
    if kind == PinRefusal.__name__:
        return record_from_map(PinRefusal, m)
    return record_from_map(PinOutcome, m)
