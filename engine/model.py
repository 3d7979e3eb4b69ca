"""A Llama-style decoder (SmolLM2's architecture) whose attention reads and writes the L1 pool."""
from __future__ import annotations

from functools import partial
from typing import Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.attention import PagedAttention
from kvtier.engine.batch import ForwardBatch, SeqChunk
from kvtier.engine.layers import MLP, RMSNorm, Rotary, empty_weight
from kvtier.engine.model_config import ModelConfig
from kvtier.engine.parallel import SINGLE, TensorParallel
from kvtier.engine.weights import check_state_dict
from kvtier.errors import ConfigError
from kvtier.kv_spec import KVSpec
from kvtier.tiers.device_pool import default_device


LayerHook = Callable[[int], None]


class KVPool(Protocol):
    """What the model needs of an L1 pool (kvtier.tiers.device_pool.DevicePool has it)."""

    spec: KVSpec
    num_pages: int

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.attn = PagedAttention(config, tp, dtype, device)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, tp, dtype, device)

    def load(self, state: Mapping[str, torch.Tensor], prefix: str) -> None:
        def w(name: str) -> torch.Tensor:
            return state[prefix + name]

        self.input_norm.weight.copy_(w("input_layernorm.weight"))
        self.post_attn_norm.weight.copy_(w("post_attention_layernorm.weight"))
        bias = tuple(w(f"self_attn.{p}_proj.bias") for p in "qkv") \
            if self.attn.qkv_bias is not None else None
        self.attn.load(w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                       w("self_attn.v_proj.weight"), w("self_attn.o_proj.weight"), bias)
        self.mlp.load(w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"), w("mlp.down_proj.weight"))

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv: tuple[torch.Tensor, torch.Tensor], wait: Callable[[], None]) -> torch.Tensor:
        q, k, v = self.attn.project(self.input_norm(h), cos, sin)
        wait()  # the layer's pool pages must be loaded (L2->L1) before attention touches them
        h = h + self.attn.attend(q, k, v, batch, *kv)
        return h + self.mlp(self.post_attn_norm(h))


class PagedLlama(nn.Module):
    """Embeddings, decoder layers, final norm and LM head for one TP rank.

    Build with `from_state_dict`; call `forward` with new tokens and their sequences' page
    tables. Holds no KV: every call names the pool it reads and writes.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"model dtype {dtype} is not supported; use float32, bfloat16 "
                              f"or float16")
        tp.check(config)
        device = torch.device(device) if device is not None else default_device()
        self.config, self.dtype, self.device, self.tp = config, dtype, device, tp
        self.embed = empty_weight(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, tp, dtype, device)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.lm_head = self.embed if config.tie_word_embeddings else empty_weight(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary = Rotary(config.head_dim, config.rope_theta, config.max_position, device)

    @classmethod
    def from_state_dict(cls, config: ModelConfig, state: Mapping[str, torch.Tensor],
                        dtype: torch.dtype = torch.float32,
                        device: torch.device | str | None = None,
                        tp: TensorParallel = SINGLE) -> "PagedLlama":
        """The model for rank `tp.rank`, from the full HF-named (unsharded) state dict."""
        check_state_dict(config, dict(state))
        model = cls(config, dtype, device, tp)
        with torch.no_grad():
            model.embed.copy_(state["model.embed_tokens.weight"])
            model.norm.weight.copy_(state["model.norm.weight"])
            if not config.tie_word_embeddings:
                model.lm_head.copy_(state["lm_head.weight"])
            for i, layer in enumerate(model.layers):
                layer.load(state, f"model.layers.{i}.")
        return model.eval()

    def kv_spec(self, page_size: int, dtype: torch.dtype | None = None) -> KVSpec:
        """The geometry of this rank's L1/L2 pools (its KV heads only)."""
        return KVSpec(num_layers=self.config.num_layers,
                      num_kv_heads=self.layers[0].attn.num_kv_heads,
                      head_dim=self.config.head_dim, page_size=page_size, dtype=dtype or self.dtype)

    def check_pool(self, kv: KVPool) -> None:
        """Raise unless `kv` has this rank's KV geometry and lives on the model's device."""
        spec, mine = kv.spec, self.kv_spec(kv.spec.page_size, kv.spec.dtype)
        if spec != mine:
            raise ConfigError(f"the KV pool's geometry {spec} does not fit this model (rank "
                              f"{self.tp.rank}/{self.tp.size}) which needs {mine}; build the pool "
                              f"from model.kv_spec(page_size)")
        pool_device = kv.layer(0)[0].device
        if pool_device.type != self.device.type:
            raise ConfigError(f"the KV pool is on {pool_device} but the model on {self.device}; "
                              f"create both on the same device")

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, seqs: Sequence[SeqChunk], kv: KVPool,
                before_layer: LayerHook | None = None, all_logits: bool = False) -> torch.Tensor:
        """Logits (float32) of each sequence's last new token, (len(seqs), vocab).

        `tokens` holds the new tokens of all `seqs`, concatenated in order. With
        `all_logits`, returns logits of every new token, (len(tokens), vocab).
        `before_layer(l)` runs right before layer l's attention touches the pool.
        """
        self.check_pool(kv)
        batch = ForwardBatch(seqs, kv.spec.page_size, kv.num_pages, self.device)
        if tokens.shape != (batch.num_tokens,):
            raise ConfigError(f"tokens has shape {tuple(tokens.shape)} but the sequences add up "
                              f"to {batch.num_tokens} new tokens")
        h = F.embedding(tokens.to(self.device), self.embed)
        cos, sin = self.rotary.table(batch.positions, self.dtype)
        for i, layer in enumerate(self.layers):
            wait = partial(before_layer, i) if before_layer is not None else _nothing
            h = layer(h, cos, sin, batch, kv.layer(i), wait)
        if not all_logits:
            h = h.index_select(0, batch.last_rows)
        return F.linear(self.norm(h), self.lm_head).float()


def _nothing() -> None:
    return None
