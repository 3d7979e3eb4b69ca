"""Gemma-3's decoder layer and the paged model that stacks it.

What differs from Llama (HF transformers' Gemma3 numerics): RMSNorms scale by (1 + w) in
float32; embeddings are multiplied by sqrt(hidden); q and k get a per-head RMSNorm before
RoPE; "sandwich" norms (after attention, and before and after the MLP); a GELU-tanh gated MLP;
the attention scale is query_pre_attn_scalar ** -0.5; most layers are SLIDING (they see only
the last `sliding_window` keys, and use a RoPE base of their own), every few layers is FULL.
The L1/L2/L3 pools keep every layer's KV; `PagedGemma3.layer_kinds` says which layers read
only their window, and the window mask lives in kvtier.engine.batch.attention_mask.
"""
from __future__ import annotations

from typing import Mapping

import torch
from torch import nn

from kvtier.engine.attention import PagedAttention
from kvtier.engine.batch import ForwardBatch
from kvtier.engine.layers import MLP, RMSNorm
from kvtier.engine.model import LayerWait, PagedLlama, load_attention_and_mlp
from kvtier.engine.model_config import Architecture, LayerKind, ModelConfig
from kvtier.engine.parallel import TensorParallel


class Gemma3Layer(nn.Module):
    """norm -> attention -> norm, + residual; norm -> MLP -> norm, + residual."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, kind: LayerKind) -> None:
        super().__init__()
        self.kind = kind

        def norm() -> RMSNorm:
            return RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device,
                           config.norm_style)

        self.input_norm, self.post_attn_norm = norm(), norm()
        self.pre_mlp_norm, self.post_mlp_norm = norm(), norm()
        self.attn = PagedAttention(config, tp, dtype, device, kind)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, tp, dtype, device,
                       config.activation)

    def load(self, state: Mapping[str, torch.Tensor], prefix: str) -> None:
        for norm, name in ((self.input_norm, "input_layernorm"),
                           (self.post_attn_norm, "post_attention_layernorm"),
                           (self.pre_mlp_norm, "pre_feedforward_layernorm"),
                           (self.post_mlp_norm, "post_feedforward_layernorm")):
            norm.weight.copy_(state[f"{prefix}{name}.weight"])
        load_attention_and_mlp(self, state, prefix)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv: tuple[torch.Tensor, torch.Tensor], wait: LayerWait) -> torch.Tensor:
        q, k, v = self.attn.project(self.input_norm(h), cos, sin)
        unreadable = wait()  # the layer's pool pages are loaded (L2->L1), or failed to be
        h = h + self.post_attn_norm(self.attn.attend(q, k, v, batch, *kv, unreadable))
        return h + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(h)))


class PagedGemma3(PagedLlama):
    """Gemma-3 over the L1 pool: PagedLlama's frame (embeddings, rotary tables per layer kind,
    layer loop, LM head) with Gemma3Layer. Gemma-3 270M has one KV head: TP 1 only."""

    ARCHITECTURE = Architecture.GEMMA3

    def make_layer(self, config: ModelConfig, kind: LayerKind, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
        return Gemma3Layer(config, self.tp, dtype, device, kind)
