"""Grouped-query attention over the paged L1 pool.

New tokens' K/V are written into their pool slots first; then every sequence reads all of
its keys, cached and new alike, back from the pool through its page table. Reading the new
keys from the pool too (rather than from the fresh tensors) makes a chunk's inputs the same
whether its prefix was computed a moment ago or came from a cache hit: the basis of the
bit-identical hit invariant, also when the pool's dtype is narrower than the model's.
"""
from __future__ import annotations

from typing import AbstractSet

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.batch import ForwardBatch
from kvtier.engine.layers import RMSNorm, Rotary, empty_weight
from kvtier.engine.model_config import LayerKind, ModelConfig
from kvtier.engine.parallel import TensorParallel


def write_kv(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Store `new` (T, H, D) at flat token slots of `cache` (num_pages, page_size, H, D)."""
    cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, new.to(cache.dtype))


def read_kv(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of a sequence, (H, length, D), gathered by its page table."""
    gathered = cache.index_select(0, pages)  # (n, page_size, H, D)
    return gathered.view(-1, *cache.shape[2:])[:length].transpose(0, 1)


class PagedAttention(nn.Module):
    """q/k/v (fused, column-parallel), q/k norms (if the config has them), rotary, paged SDPA,
    o_proj (row-parallel + all-reduce). A SLIDING layer reads only the pages its window
    reaches and masks the keys before it (the batch's `window` span), in the pool's sidecar,
    which keeps sliding-window KV only for the pages some window still needs."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, kind: LayerKind = LayerKind.FULL) -> None:
        super().__init__()
        self.tp, self.kind = tp, kind
        self.scale = config.attention_scale  # None: SDPA's own head_dim ** -0.5
        self.num_heads, self.num_kv_heads = tp.local_heads(config)
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv = empty_weight(self.q_size + 2 * self.kv_size, config.hidden_size,
                          dtype=dtype, device=device)
        self.qkv_bias = empty_weight(self.q_size + 2 * self.kv_size, dtype=dtype,
                                     device=device) if config.attention_bias else None
        self.o = empty_weight(config.hidden_size, self.q_size, dtype=dtype, device=device)
        norm = lambda: RMSNorm(config.head_dim, config.rms_norm_eps, dtype, device,  # noqa: E731
                               config.norm_style)
        self.q_norm, self.k_norm = (norm(), norm()) if config.qk_norm else (None, None)

    def load(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
             bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> None:
        """Take this rank's heads of full HF weights (and of the q/k/v biases, if any)."""
        rows = self.tp.rows
        self.qkv.copy_(torch.cat([rows(q), rows(k), rows(v)]))
        self.o.copy_(self.tp.cols(o))
        if self.qkv_bias is not None:
            assert bias is not None, "a model with attention_bias needs q/k/v biases"
            self.qkv_bias.copy_(torch.cat([rows(b) for b in bias]))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (T, Hq, D), k and v (T, Hkv, D), rotary applied to q and k."""
        q, k, v = F.linear(x, self.qkv, self.qkv_bias).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # per head, before rotary
            q, k = self.q_norm(q), self.k_norm(k)
        return (Rotary.apply(q, cos, sin), Rotary.apply(k, cos, sin),
                v.view(-1, self.num_kv_heads, self.head_dim))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch,
               k_cache: torch.Tensor, v_cache: torch.Tensor,
               unreadable: AbstractSet[int] | None = None) -> torch.Tensor:
        """Write k/v into the pool, attend per sequence, project out: (T, hidden). A SLIDING
        layer of a pool with a sidecar (`batch.sliding_slots`) writes and reads its window
        there. The rows of sequences that read an `unreadable` page (a failed load's partial
        data on this rank) come out NaN, before the row-parallel all-reduce: every rank then
        gets NaN in those rows, and only those (kvtier.engine.step_forwards)."""
        sliding = self.kind is LayerKind.SLIDING
        slots = batch.sliding_slots if sliding and batch.sliding_slots is not None else batch.slots
        write_kv(k_cache, slots, k)
        write_kv(v_cache, slots, v)
        out = torch.empty(q.shape[0], self.num_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for view in batch.views:  # sequences differ in length: one SDPA each
            span = view.window if sliding else view.full
            keys = read_kv(k_cache, span.pages, span.length).to(q.dtype)
            values = read_kv(v_cache, span.pages, span.length).to(q.dtype)
            query = q[view.rows].transpose(0, 1)  # (Hq, T, D)
            o = F.scaled_dot_product_attention(query[None], keys[None], values[None],
                                               attn_mask=span.mask, scale=self.scale,
                                               enable_gqa=True)
            out[view.rows] = o[0].transpose(0, 1)
        for rows in batch.rows_reading(unreadable):
            out[rows] = float("nan")
        return self.tp.all_reduce(F.linear(out.view(q.shape[0], self.q_size), self.o))
