"""What a rank actor returns from a step or an abort, as msgpack (DESIGN: actors exchange
msgpack, never pickles).

Why not let Ray pickle the `Output` dataclasses: a pickle runs code when it is loaded and ties
both sides to one class layout; these are plain values, checked when decoded, so a payload from
a peer of another version fails with a clear `MessageError`. The prefill logits stay behind
(a vocabulary of floats per request; nothing past the rank needs them).
"""
from __future__ import annotations

from typing import Any, NamedTuple

import msgpack

from kvtier.engine.request import CachedTokens, FinishReason, Output
from kvtier.engine.sampling import TokenLogprob
from kvtier.messages import MessageError, unpack_payload
from kvtier.tiers.cache_types import RequestLengths

_OUTPUT_FIELDS = ("id", "prompt", "tokens", "text", "finish", "lengths", "cached", "ttft_s",
                  "tps", "queue_s", "logprobs")


class Progress(NamedTuple):
    """A running request's output so far (rank 0 reports it when it changed)."""

    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when it asked


class StepReport(NamedTuple):
    finished: list[Output]  # requests that finished in the step (prefill logits dropped)
    progress: dict[int, Progress]  # rank 0: request id -> its output so far, changed ones
    events: bytes | None  # rank 0: a CacheEventBatch (msgpack) when watching, else None
    handoffs: list = []  # [request id, HandoffSent wire] per request this rank handed off


def logprobs_to_wire(logprobs: tuple[TokenLogprob, ...] | None) -> list | None:
    """Log-probabilities as plain lists: [[token, logprob, [[token, logprob], ...]], ...]."""
    if logprobs is None:
        return None
    return [[lp.token, lp.logprob, [list(p) for p in lp.top]] for lp in logprobs]


def logprobs_from_wire(m: Any) -> tuple[TokenLogprob, ...] | None:
    if m is None:
        return None
    return tuple(TokenLogprob(int(t), float(lp), tuple((int(i), float(v)) for i, v in top))
                 for t, lp, top in m)


def _output_map(out: Output) -> dict[str, Any]:
    return {"id": out.request_id, "prompt": list(out.prompt), "tokens": list(out.tokens),
            "text": out.text, "finish": out.finish_reason.value,
            "lengths": list(out.lengths), "cached": list(out.cached), "ttft_s": out.ttft_s,
            "tps": out.decode_tokens_per_s, "queue_s": out.queue_s,
            "logprobs": logprobs_to_wire(out.logprobs)}


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
                      logprobs=logprobs_from_wire(m["logprobs"]))
    except (TypeError, ValueError) as exc:
        raise MessageError(f"a bad Output record: {exc}") from exc


def encode_output(out: Output | None) -> bytes:
    return msgpack.packb(None if out is None else _output_map(out), use_bin_type=True)


def decode_output(data: bytes) -> Output | None:
    m = unpack_payload("Output", data)
    return None if m is None else _output(m)


def encode_report(report: StepReport) -> bytes:
    return msgpack.packb({"finished": [_output_map(o) for o in report.finished],
                          "progress": [[i, list(p.tokens), logprobs_to_wire(p.logprobs)]
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
        progress = {int(i): Progress(tuple(int(t) for t in toks), logprobs_from_wire(lps))
                    for i, toks, lps in m["progress"]}
    except (TypeError, ValueError) as exc:
        raise MessageError(f"StepReport.progress: {exc}") from exc
    try:
        handoffs = [[int(i), list(sent)] for i, sent in m["handoffs"]]
    except (TypeError, ValueError) as exc:
        raise MessageError(f"StepReport.handoffs: {exc}") from exc
    return StepReport([_output(o) for o in m["finished"]], progress, m["events"], handoffs)
