"""What a rank actor returns from a step or an abort, as msgpack (docs/architecture.md
invariant 10: actors exchange msgpack, never pickles).

Why not let Ray pickle the `Output` dataclasses: a pickle runs code when it is loaded and ties
both sides to one class layout; these are plain values, checked when decoded, so a payload from
a peer of another version fails with a clear `MessageError`. The prefill logits stay behind
(a vocabulary of floats per request; nothing past the rank needs them).
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import msgpack

from kvtier.engine.request import CachedTokens, FinishReason, Output, Resume
from kvtier.engine.sampling import TokenLogprob
from kvtier.messages import MessageError, unpack_payload
from kvtier.tiers.cache_types import RequestLengths

_OUTPUT_FIELDS = ("id", "prompt", "tokens", "text", "finish", "lengths", "cached", "ttft_s",
                  "tps", "queue_s", "logprobs", "error")


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
    finished: list[Output]  # requests that finished in the step (prefill logits dropped)
    progress: dict[int, Progress]  # rank 0: request id -> its output so far, changed ones
    events: bytes | None  # rank 0: a CacheEventBatch (msgpack) when watching, else None
    handoffs: list = []  # [request id, HandoffSent wire] per request this rank handed off


def logprobs_to_wire(logprobs: Sequence[TokenLogprob] | None) -> list | None:
    """Log-probabilities as plain lists: [[token, logprob, [[token, logprob], ...]], ...]."""
    if logprobs is None:
        return None
    return [lp.to_wire() for lp in logprobs]


def logprobs_from_wire(m: Any) -> tuple[TokenLogprob, ...] | None:
    if m is None:
        return None
    return tuple(TokenLogprob.from_wire(lp) for lp in m)


def resume_to_wire(resume: Resume | None) -> list | None:
    return None if resume is None else resume.to_wire()


def resume_from_wire(m: Any) -> Resume | None:
    if m is None:
        return None
    try:
        return Resume.from_wire(m)
    except (TypeError, ValueError) as exc:
        raise MessageError(f"a bad Resume record: {exc}") from exc


def _output_map(out: Output) -> dict[str, Any]:
    return {"id": out.request_id, "prompt": list(out.prompt), "tokens": list(out.tokens),
            "text": out.text, "finish": out.finish_reason.value,
            "lengths": list(out.lengths), "cached": list(out.cached), "ttft_s": out.ttft_s,
            "tps": out.decode_tokens_per_s, "queue_s": out.queue_s,
            "logprobs": logprobs_to_wire(out.logprobs), "error": out.error}


def _output(m: Any) -> Output:
    if not isinstance(m, dict) or set(m) != set(_OUTPUT_FIELDS):
        raise MessageError(f"an Output record needs exactly {', '.join(_OUTPUT_FIELDS)}")
    try:
        return Output(int(m["id"]), tuple(int(t) for t in m["prompt"]),
                      tuple(int(t) for t in m["tokens"]), m["text"],
                      FinishReason(m["finish"]), RequestLengths(*(int(x) for x in m["lengths"])),
                      CachedTokens(*(int(x) for x in m["cached"])),
                      None if m["ttft_s"] is None else float(m["ttft_s"]),
                      None if m["tps"] is None else float(m["tps"]),
                      queue_s=None if m["queue_s"] is None else float(m["queue_s"]),
                      logprobs=logprobs_from_wire(m["logprobs"]),
                      error=None if m["error"] is None else str(m["error"]))
    except (TypeError, ValueError) as exc:
        raise MessageError(f"a bad Output record: {exc}") from exc


def encode_output(out: Output | None) -> bytes:
    return msgpack.packb(None if out is None else _output_map(out), use_bin_type=True)


def decode_output(data: bytes) -> Output | None:
    m = unpack_payload("Output", data)
    return None if m is None else _output(m)


def encode_report(report: StepReport) -> bytes:
    return msgpack.packb({"finished": [_output_map(o) for o in report.finished],
                          "progress": [[i, p.start, list(p.tokens),
                                        logprobs_to_wire(p.logprobs)]
                                       for i, p in report.progress.items()],
                          "events": report.events, "handoffs": report.handoffs},
                         use_bin_type=True)


def decode_report(data: bytes) -> StepReport:
    m = unpack_payload("StepReport", data)
    if not isinstance(m, dict) or set(m) != {"finished", "progress", "events", "handoffs"}:
        raise MessageError("a StepReport record needs exactly finished, progress, events, "
                           "handoffs")
    if m["events"] is not None and not isinstance(m["events"], bytes):
        raise MessageError("StepReport.events: expected bytes or nil")
    try:
        progress = {int(i): Progress(int(start), tuple(int(t) for t in toks),
                                     logprobs_from_wire(lps))
                    for i, start, toks, lps in m["progress"]}
    except (TypeError, ValueError) as exc:
        raise MessageError(f"StepReport.progress: {exc}") from exc
    try:
        handoffs = [[int(i), list(sent)] for i, sent in m["handoffs"]]
    except (TypeError, ValueError) as exc:
        raise MessageError(f"StepReport.handoffs: {exc}") from exc
    return StepReport([_output(o) for o in m["finished"]], progress, m["events"], handoffs)
