"""Prefill, decode and mixed forwards: a model bound to one L1 pool.

Two modes. By default (`deterministic=False`) a hit is reused up to any page boundary and a
forward may hold prefill pieces of several requests next to decodes (`forward`): fast, and a
hit gives the same tokens as the same request served with those pages still in L1, but not
bit-identical logits to a cold run, because a matmul's result for a row depends on how many
rows run together.

Deterministic mode (`deterministic=True`) keeps that bit-identity. Chunks sit on an absolute
grid: chunk ends at fixed multiples of `chunk_tokens` (a multiple of the page size), counted
from position 0, make a request that resumes at a cache hit on that grid compute exactly the
chunks a cold run computes, one sequence per forward (`prefill`), so its logits are
bit-identical. `usable_prefix(hit)` then rounds a hit down to the grid, because pages past it
may come from a request's short last chunk. KV written by decode steps (generated tokens) is
computed one row per sequence and is not bit-identical to prefilling the same tokens.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from kvtier.engine.batch import SeqChunk
from kvtier.engine.model import KVPool, LayerHook, PagedLlama
from kvtier.errors import CacheUsageError, ConfigError

log = logging.getLogger(__name__)


def chunk_bounds(start: int, end: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) cut at absolute multiples of `chunk_tokens`: [(start, stop), ...]."""
    bounds = []
    pos = start
    while pos < end:
        stop = min(end, (pos // chunk_tokens + 1) * chunk_tokens)
        bounds.append((pos, stop))
        pos = stop
    return bounds


class ModelRunner:
    """Runs `model` against pool `kv`; `before_layer(l)` is the cache's per-layer load wait."""

    def __init__(self, model: PagedLlama, kv: KVPool, chunk_tokens: int | None = None,
                 before_layer: LayerHook | None = None, deterministic: bool = False) -> None:
        model.check_pool(kv)
        self.model, self.kv = model, kv
        self.page_size = kv.spec.page_size
        self.chunk_tokens = self._check_chunk(chunk_tokens)
        self.before_layer = before_layer
        self.deterministic = deterministic

    def _check_chunk(self, chunk_tokens: int | None) -> int:
        chunk = self.page_size if chunk_tokens is None else chunk_tokens
        if chunk < 1 or chunk % self.page_size:
            raise ConfigError(f"chunk_tokens ({chunk}) must be a positive multiple of the "
                              f"page size ({self.page_size}) so chunks end on page boundaries")
        return chunk

    def usable_prefix(self, cached_len: int, num_tokens: int,
                      window_ok: Callable[[int], bool] | None = None) -> int:
        """How much of a `cached_len` hit to reuse: whole pages, leaving at least one token to
        compute (the next token's logits come from it); in deterministic mode rounded down to
        the chunk grid, so the result stays bit-identical to a cold run. `window_ok(tokens)`
        (a hybrid model's cache): whether a hit that long has its sliding-window KV; the
        longest one that does is used."""
        grain = self.chunk_tokens if self.deterministic else self.page_size
        usable = max(0, min(cached_len, num_tokens - 1)) // grain * grain
        if window_ok is not None:
            while usable and not window_ok(usable):
                usable -= grain
        return usable

    def prefill(self, tokens: Sequence[int] | torch.Tensor, start_pos: int,
                page_table: Sequence[int], chunk_tokens: int | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Compute positions [start_pos, len(tokens)) of one sequence; logits of its last token.

        `tokens` is the whole sequence; KV of positions < start_pos must already be in the
        pool pages `page_table` names (computed earlier or a cache hit). For the
        bit-identical hit invariant, start_pos must lie on the chunk grid.
        Returns (vocab,) float32 logits, or (len - start_pos, vocab) with `all_logits`.
        """
        chunk = self.chunk_tokens if chunk_tokens is None else self._check_chunk(chunk_tokens)
        ids = torch.as_tensor(tokens, dtype=torch.int64)
        if not 0 <= start_pos < len(ids):
            raise CacheUsageError(f"start_pos {start_pos} leaves nothing to prefill in a "
                                  f"{len(ids)}-token sequence; keep at least one token to compute")
        if start_pos % chunk:
            log.debug("prefill resumes at %d, off the %d-token chunk grid: correct, but not "
                      "bit-identical to a cold run", start_pos, chunk)
        outputs = []
        for lo, hi in chunk_bounds(start_pos, len(ids), chunk):
            logits = self._call(ids[lo:hi], [SeqChunk(page_table, lo, hi - lo)], all_logits)
            outputs.append(logits)
        return torch.cat(outputs) if all_logits else outputs[-1][0]

    def forward(self, tokens: Sequence[int], seqs: Sequence[SeqChunk]) -> torch.Tensor:
        """One forward over several sequences' new tokens (prefill pieces and decodes mixed;
        `tokens` concatenated in `seqs` order): (len(seqs), vocab) float32 logits, each of
        its sequence's last new token."""
        if len(tokens) != sum(s.num_tokens for s in seqs):
            raise CacheUsageError(f"{len(tokens)} tokens for sequences that add up to "
                                  f"{sum(s.num_tokens for s in seqs)} new tokens")
        return self._call(torch.as_tensor(list(tokens), dtype=torch.int64), seqs)

    def decode(self, tokens: Sequence[int],
               seqs: Sequence[tuple[Sequence[int], int]]) -> torch.Tensor:
        """One step for a batch: token i sits at position seqs[i][1] of a sequence whose pages
        are seqs[i][0]. Returns (batch, vocab) float32 logits."""
        if len(tokens) != len(seqs):
            raise CacheUsageError(f"{len(tokens)} tokens for {len(seqs)} sequences")
        chunks = [SeqChunk(pages, pos, 1) for pages, pos in seqs]
        return self._call(torch.as_tensor(list(tokens), dtype=torch.int64), chunks)

    def _call(self, tokens: torch.Tensor, seqs: Sequence[SeqChunk],
              all_logits: bool = False) -> torch.Tensor:
        """The model on `seqs`. A hybrid model's pool: the pages its new tokens write get
        sidecar slots (the engine gave its requests' pages theirs already; a bare runner's get
        them here), and the pages its sliding layers read are held for the call; a page read
        without one raises (its sliding KV is gone), never reads another page's."""
        sidecar = self.kv.sidecar if self.kv.spec.sliding is not None else None
        if sidecar is None:
            return self.model(tokens, seqs, self.kv, self.before_layer, all_logits)
        window, page = self.kv.spec.sliding.window, self.page_size
        written, read = [], []
        for seq in seqs:
            first, new = max(0, seq.start_pos - window + 1) // page, seq.start_pos // page
            read += seq.page_table[first:new]
            written += seq.page_table[new:-(-seq.end_pos // page)]
        if not sidecar.assign(written):
            raise CacheUsageError(f"the pool's sliding-window sidecar has room for "
                                  f"{sidecar.room()} more pages but this forward writes "
                                  f"{len(written)}; give the pool more slots")
        held = sidecar.lock(read)  # a page read without a slot is an error (slot_table)
        try:
            return self.model(tokens, seqs, self.kv, self.before_layer, all_logits)
        finally:
            sidecar.unlock(written)
            sidecar.unlock(held)
