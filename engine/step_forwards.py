"""Runs one step's planned prefill and decodes through the model, and samples.

By default the work is packed into forwards of up to `chunk_tokens` new tokens that batch
several requests' prefill pieces with every decode (`forward_plan.pack_forwards`): one
variable-length attention call per sequence over its page table, one matmul for all rows.
In deterministic mode each prefill chunk runs alone on the absolute chunk grid and the
decodes run as one batch of their own, so a hit gives bit-identical logits to a cold run.

The caller (the scheduler) owns the requests' lifecycle: this advances `pos`, turns a request
whose prompt is done into DECODING with its first token, appends sampled tokens, and reports
the requests whose last token was sampled in `ended` (appended forward by forward, so that a
failure in a later forward leaves what earlier ones finished reported).

A failed L2->L1 load does not stop a forward. At TP > 1 the rank whose load failed must not
leave it: its peers would wait in the forward's all-reduces until the collective times out,
and the instance would rebuild every rank. So it goes on, with the rows of the sequences that
read a page of that load poisoned (NaN in the attention output before the row-parallel
all-reduce, kvtier.engine.attention): the all-reduce takes NaN to every rank, in those rows
only, so every rank finds the same non-finite logits in the same forward, without a word more.
Those requests sample nothing: they are reported in `failed` (the scheduler recomputes them),
and their later pieces of the step are dropped on every rank alike.
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch

from kvtier.engine.batch import SeqChunk
from kvtier.engine.forward_plan import Forward, Piece, pack_forwards
from kvtier.engine.request import Request
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import SamplingError
from kvtier.tiers.sliding_kv import SlidingKV

log = logging.getLogger(__name__)


class StepForwards:
    """The model calls of a step; `count` is how many the last `run` made.

    With a hybrid model's cache (`sliding`), each forward first gives the pages its new tokens
    write sliding-window slots, and afterwards lets go of what no later query of the request
    reads (SlidingKV.prepare / prune)."""

    def __init__(self, runner: ModelRunner, sliding: SlidingKV | None = None) -> None:
        self.runner = runner
        self.sliding = sliding
        self.count = 0
        self.failed: list[Request] = []  # the last run's requests with non-finite logits

    def _prepare(self, req: Request, start: int, stop: int) -> None:
        if self.sliding is not None and req.lookup is not None and req.lookup.sliding is not None:
            self.sliding.prepare(req.lookup.sliding, req.pages, start, stop)

    def _prune(self, req: Request, pos: int) -> None:
        if self.sliding is not None and req.lookup is not None and req.lookup.sliding is not None:
            self.sliding.prune(req.lookup.sliding, req.pages, req.num_shared, pos,
                               len(req.prompt))

    def run(self, plan: Sequence[tuple[Request, int]], decoding: Sequence[Request],
            ended: list[Request]) -> None:
        """Prefill each (request, stop) of `plan` from its `pos` to `stop`; decode
        `decoding` one token each."""
        self.count = 0
        self.failed = []
        if self.runner.deterministic:
            self._one_by_one(plan, decoding, ended)
            return
        spans = [Piece(r, r.pos, stop) for r, stop in plan if stop > r.pos]
        for fwd in pack_forwards(spans, decoding, self.runner.chunk_tokens):
            self._forward(fwd, ended)

    def _forward(self, fwd: Forward, ended: list[Request]) -> None:
        if self.failed:  # a failed request's later pieces: not computed (on any rank)
            fwd = fwd._replace(pieces=tuple(p for p in fwd.pieces if p.req not in self.failed))
            if not fwd.pieces and not fwd.decodes:
                return
        tokens: list[int] = []
        seqs: list[SeqChunk] = []
        for piece in fwd.pieces:
            req = piece.req
            tokens += req.prompt[piece.start:piece.stop]
            seqs.append(SeqChunk(req.pages, piece.start, piece.num_tokens))
            self._prepare(req, piece.start, piece.stop)
        for req in fwd.decodes:
            tokens.append(req.output[-1])
            seqs.append(SeqChunk(req.pages, req.kv_len, 1))
            self._prepare(req, req.kv_len, req.kv_len + 1)
        logits = self.runner.forward(tokens, seqs)
        self.count += 1
        finite = torch.isfinite(logits).all(dim=-1).tolist()
        for req in fwd.decodes:
            self._prune(req, req.kv_len + 1)
        for row, piece in enumerate(fwd.pieces):
            piece.req.pos = piece.stop
            self._prune(piece.req, piece.stop)
            if self._fails(piece.req, finite[row]):
                continue
            if piece.stop == len(piece.req.prompt):
                _first_token(piece.req, logits[row], ended)
        self._sample(fwd.decodes, logits[len(fwd.pieces):], finite[len(fwd.pieces):], ended)

    def _fails(self, req: Request, finite: bool) -> bool:
        """Whether `req`'s row came out non-finite (it read a page a load failed to fill)."""
        if not finite and req not in self.failed:
            self.failed.append(req)
        return not finite

    def _sample(self, batch: Sequence[Request], logits: torch.Tensor, finite: Sequence[bool],
                ended: list[Request]) -> None:
        for row, req in enumerate(batch):
            if not self._fails(req, finite[row]):
                _take(req, logits[row], ended)

    def _one_by_one(self, plan: Sequence[tuple[Request, int]], decoding: Sequence[Request],
                    ended: list[Request]) -> None:
        for req, stop in plan:
            if stop <= req.pos:
                continue
            self._prepare(req, req.pos, stop)
            logits = self.runner.prefill(req.prompt[:stop], req.pos, req.pages)
            self.count += len(range(req.pos, stop, self.runner.chunk_tokens))
            req.pos = stop
            self._prune(req, stop)
            if self._fails(req, bool(torch.isfinite(logits).all())):
                continue  # a poisoned chunk's NaN KV reaches the last chunk's logits
            if stop == len(req.prompt):
                _first_token(req, logits, ended)
        if decoding:
            for req in decoding:
                self._prepare(req, req.kv_len, req.kv_len + 1)
            logits = self.runner.decode([r.output[-1] for r in decoding],
                                        [(r.pages, r.kv_len) for r in decoding])
            self.count += 1
            for req in decoding:
                self._prune(req, req.kv_len + 1)
            self._sample(decoding, logits, torch.isfinite(logits).all(dim=-1).tolist(), ended)


def _first_token(req: Request, logits: torch.Tensor, ended: list[Request]) -> None:
    req.prefill_logits = logits.float().cpu()
    req.start_decoding()
    _take(req, logits, ended)


def _take(req: Request, logits: torch.Tensor, ended: list[Request]) -> None:
    """Sample `req`'s next token and record it; a failure ends this request alone (every TP
    rank sees the same logits, so every rank ends it alike)."""
    try:
        done = req.append(req.sampler(logits))
    except Exception as exc:  # noqa: BLE001 - one request's failure must not stop its batch
        log.exception("request %d: choosing its next token failed; ending it alone", req.id)
        detail = f": {exc}" if isinstance(exc, SamplingError) else ""  # ours: safe to show
        req.fail(f"choosing its next token failed ({type(exc).__name__}{detail})")
        done = True
    if done:
        ended.append(req)
