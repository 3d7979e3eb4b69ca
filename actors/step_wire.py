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
from kvtier.messages import MessageError, unpack_payload
from kvtier.tiers.cache_types import RequestLengths

_OUTPUT_FIELDS = ("id", "prompt", "tokens", "text", "finish", "lengths", "cached", "ttft_s",
                  "tps", "queue_s")


class StepReport(NamedTuple):
    finished: list[Output]  # requests that finished in the step (prefill logits dropped)
    progress: dict[int, tuple[int, ...]]  # rank 0: request id -> tokens so far, changed ones
    events: bytes | None  # rank 0: a CacheEventBatch (msgpack) when watching, else None


def _output_map(out: Output) -> dict[str, Any]:
    return {"id": out.request_id, "prompt": list(out.prompt), "tokens": list(out.tokens),
            "text": out.text, "finish": out.finish_reason.value,
            "lengths": list(out.lengths), "cached": list(out.cached), "ttft_s": out.ttft_s,
            "tps": out.decode_tokens_per_s, "queue_s": out.queue_s}


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
                      queue_s=None if m["queue_s"] is None else float(m["queue_s"]))
    except (TypeError, ValueError) as exc:
        raise MessageError(f"a bad Output record: {exc}") from exc


def encode_output(out: Output | None) -> bytes:
    return msgpack.packb(None if out is None else _output_map(out), use_bin_type=True)


def decode_output(data: bytes) -> Output | None:
    m = unpack_payload("Output", data)
    return None if m is None else _output(m)


def encode_report(report: StepReport) -> bytes:
    return msgpack.packb({"finished": [_output_map(o) for o in report.finished],
                          "progress": [[i, list(t)] for i, t in report.progress.items()],
                          "events": report.events}, use_bin_type=True)


def decode_report(data: bytes) -> StepReport:
    m = unpack_payload("StepReport", data)
    if not isinstance(m, dict) or set(m) != {"finished", "progress", "events"}:
        raise MessageError("a StepReport record needs exactly finished, progress, events")
    if m["events"] is not None and not isinstance(m["events"], bytes):
        raise MessageError("StepReport.events: expected bytes or nil")
    try:
        progress = {int(i): tuple(int(t) for t in toks) for i, toks in m["progress"]}
    except (TypeError, ValueError) as exc:
        raise MessageError(f"StepReport.progress: {exc}") from exc
    return StepReport([_output(o) for o in m["finished"]], progress, m["events"])
