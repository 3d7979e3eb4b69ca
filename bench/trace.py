"""The request trace format (JSON Lines) and a generator for it.

A header line, then immutable token runs (`segment`), then `request` lines in arrival order
whose prompt and output are lists of segment ids. Conversations reuse their earlier turns
verbatim, so prefix reuse comes from the structure, not from luck.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from kvtier.errors import KvtierError

TRACE_VERSION = 1


class TraceError(KvtierError, ValueError):
    """A trace file that does not follow the format."""


@dataclass(frozen=True)
class TraceRequest:
    id: int
    conv: int
    turn: int
    prompt: tuple[int, ...]  # segment ids
    output: int  # segment id


@dataclass(frozen=True)
class Trace:
    header: dict
    segments: dict[int, tuple[int, ...]]
    requests: list[TraceRequest]

    def prompt_tokens(self, request: TraceRequest) -> tuple[int, ...]:
        out: list[int] = []
        for seg in request.prompt:
            out.extend(self.segments[seg])
        return tuple(out)

    def output_tokens(self, request: TraceRequest) -> tuple[int, ...]:
        return self.segments[request.output]


def read_trace(path: str | Path) -> Trace:
    header: dict | None = None
    segments: dict[int, tuple[int, ...]] = {}
    requests: list[TraceRequest] = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}; write one with "
                         "`kvtier bench gen-trace --out FILE`") from exc
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                kind = rec["type"]
                if kind == "header":
                    if rec.get("version") != TRACE_VERSION:
                        raise TraceError(f"{path}: trace version {rec.get('version')} is not {TRACE_VERSION}")
                    header = rec
                elif kind == "segment":
                    segments[int(rec["id"])] = tuple(int(t) for t in rec["tokens"])
                elif kind == "request":
                    requests.append(TraceRequest(
                        int(rec["id"]), int(rec["conv"]), int(rec["turn"]),
                        tuple(int(s) for s in rec["prompt"]), int(rec["output"]),
                    ))
                else:
                    raise TraceError(f"{path}:{lineno}: unknown record type {kind!r}")
            except (KeyError, TypeError, ValueError) as exc:
                if isinstance(exc, TraceError):
                    raise
                raise TraceError(f"{path}:{lineno}: bad trace record: {exc}") from exc
    if header is None:
        raise TraceError(f"{path}: no header line; is this a kvtier trace?")
    for r in requests:
        missing = [s for s in (*r.prompt, r.output) if s not in segments]
        if missing:
            raise TraceError(f"{path}: request {r.id} names unknown segments {missing[:3]}")
    return Trace(header, segments, requests)


@dataclass(frozen=True)
class TraceShape:
    conversations: int = 400
    turns: int = 5
    system_prompts: int = 4
    system_tokens: int = 512
    user_tokens: int = 128
    output_tokens: int = 64
    slots: int = 16  # conversations in flight, served round-robin
    vocab: int = 32000
    seed: int = 0


def generate(shape: TraceShape) -> Iterator[dict]:
    """Trace records in file order: header, segments, requests."""
    rng = random.Random(shape.seed)
    yield {"type": "header", "version": TRACE_VERSION, "generator": "kvtier bench gen-trace",
           **shape.__dict__}
    next_seg = 0

    def segment(length: int) -> tuple[int, dict]:
        nonlocal next_seg
        seg_id, next_seg = next_seg, next_seg + 1
        return seg_id, {"type": "segment", "id": seg_id,
                        "tokens": [rng.randrange(shape.vocab) for _ in range(length)]}

    records: list[dict] = []
    systems = []
    for _ in range(shape.system_prompts):
        sid, rec = segment(shape.system_tokens)
        systems.append(sid)
        records.append(rec)
    history: dict[int, list[int]] = {}
    queue = list(range(min(shape.slots, shape.conversations)))
    started = len(queue)
    turn_of: dict[int, int] = {}
    requests: list[dict] = []
    while queue:
        conv = queue.pop(0)
        turn = turn_of.get(conv, 0)
        hist = history.setdefault(conv, [systems[conv % len(systems)]])
        uid, urec = segment(shape.user_tokens)
        oid, orec = segment(shape.output_tokens)
        records += [urec, orec]
        prompt = hist + [uid]
        requests.append({"type": "request", "id": len(requests), "conv": conv, "turn": turn,
                         "prompt": prompt, "output": oid})
        hist[:] = prompt + [oid]
        turn_of[conv] = turn + 1
        if turn + 1 < shape.turns:
            queue.append(conv)
        elif started < shape.conversations:
            queue.append(started)
            started += 1
        if turn + 1 >= shape.turns:
            del history[conv]
    yield from records
    yield from requests


def write_trace(path: str | Path, shape: TraceShape) -> int:
    count = 0
    with open(path, "w", encoding="utf-8") as f:
        for rec in generate(shape):
            f.write(json.dumps(rec, separators=(",", ":")) + "\n")
            count += rec["type"] == "request"
    return count
