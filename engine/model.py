"""A Llama-style decoder (SmolLM2's architecture) whose attention reads and writes the L1 pool.

PagedLlama is also the frame other architectures reuse (kvtier.engine.gemma3): embeddings,
one rotary table per layer kind, the layer loop with its per-layer hook, final norm, LM head,
the pool checks. A subclass names its decoder layer in `make_layer`.
"""
from __future__ import annotations

from functools import partial
from typing import AbstractSet, Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.attention import PagedAttention
from kvtier.engine.batch import ForwardBatch, SeqChunk
from kvtier.engine.layers import MLP, RMSNorm, Rotary, empty_weight
from kvtier.engine.model_config import Architecture, LayerKind, ModelConfig
from kvtier.engine.parallel import SINGLE, TensorParallel
from kvtier.engine.weights import check_state_dict
from kvtier.errors import ConfigError
from kvtier.kv_spec import KVSpec
from kvtier.tiers.device_pool import default_device
from kvtier.tiers.sidecar import Sidecar


# Waits for the loads of the pool's layer l; returns the L1 pages nobody may read (a failed
# load's), whose readers' rows the attention poisons (kvtier.engine.step_forwards), or None.
LayerHook = Callable[[int], AbstractSet[int] | None]
LayerWait = Callable[[], AbstractSet[int] | None]


class KVPool(Protocol):
    """What the model needs of an L1 pool (kvtier.tiers.device_pool.DevicePool has it)."""

    spec: KVSpec
    num_pages: int
    sidecar: Sidecar | None  # a hybrid model's sliding-window layers (spec.sliding)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def load_attention_and_mlp(layer: nn.Module, state: Mapping[str, torch.Tensor],
                           prefix: str) -> None:
    """`layer.attn` and `layer.mlp` (with biases and q/k norms where they have them) from
    HF names under `prefix`."""
    def w(name: str) -> torch.Tensor:
        return state[prefix + name]

    attn = layer.attn
    bias = tuple(w(f"self_attn.{p}_proj.bias") for p in "qkv") \
        if attn.qkv_bias is not None else None
    attn.load(w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
              w("self_attn.v_proj.weight"), w("self_attn.o_proj.weight"), bias)
    if attn.q_norm is not None and attn.k_norm is not None:
        attn.q_norm.weight.copy_(w("self_attn.q_norm.weight"))
        attn.k_norm.weight.copy_(w("self_attn.k_norm.weight"))
    layer.mlp.load(w("mlp.gate_proj.weight"), w("mlp.up_proj.weight"),
                   w("mlp.down_proj.weight"))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, kind: LayerKind = LayerKind.FULL) -> None:
        super().__init__()
        self.kind = kind
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.attn = PagedAttention(config, tp, dtype, device, kind)
        self.post_attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device)
        self.mlp = MLP(config.hidden_size, config.intermediate_size, tp, dtype, device,
                       config.activation)

    def load(self, state: Mapping[str, torch.Tensor], prefix: str) -> None:
        self.input_norm.weight.copy_(state[prefix + "input_layernorm.weight"])
        self.post_attn_norm.weight.copy_(state[prefix + "post_attention_layernorm.weight"])
        load_attention_and_mlp(self, state, prefix)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: ForwardBatch,
                kv: tuple[torch.Tensor, torch.Tensor], wait: LayerWait) -> torch.Tensor:
        q, k, v = self.attn.project(self.input_norm(h), cos, sin)
        unreadable = wait()  # the layer's pool pages are loaded (L2->L1), or failed to be
        h = h + self.attn.attend(q, k, v, batch, *kv, unreadable)
        return h + self.mlp(self.post_attn_norm(h))


class PagedLlama(nn.Module):
    """Embeddings, decoder layers, final norm and LM head for one TP rank.

    Build with `from_state_dict`; call `forward` with new tokens and their sequences' page
    tables. Holds no KV: every call names the pool it reads and writes.
    """

    ARCHITECTURE = Architecture.LLAMA

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ConfigError(f"model dtype {dtype} is not supported; use float32, bfloat16 "
                              f"or float16")
        if config.architecture is not self.ARCHITECTURE:
            raise ConfigError(f"{config.name!r} is a {config.architecture} model, not "
                              f"{self.ARCHITECTURE}; build it with kvtier.engine.architectures."
                              f"build_model")
        tp.check(config)
        device = torch.device(device) if device is not None else default_device()
        self.config, self.dtype, self.device, self.tp = config, dtype, device, tp
        self.embed = empty_weight(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(self.make_layer(config, kind, dtype, device)
                                    for kind in config.layer_kinds)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, device,
                            config.norm_style)
        self.lm_head = self.embed if config.tie_word_embeddings else empty_weight(
            config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        # One table per layer kind: Gemma's sliding layers use another RoPE base.
        self.rotaries = nn.ModuleDict({
            kind.value: Rotary(config.head_dim, config.rope_theta_of(kind), config.max_position,
                               device) for kind in dict.fromkeys(config.layer_kinds)})

    def make_layer(self, config: ModelConfig, kind: LayerKind, dtype: torch.dtype,
                   device: torch.device) -> nn.Module:
        return DecoderLayer(config, self.tp, dtype, device, kind)

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's kind: which keep every key (FULL) and which read only their window."""
        return self.config.layer_kinds

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

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        h = F.embedding(tokens.to(self.device), self.embed)
        if self.config.embed_scale != 1.0:  # Gemma: sqrt(hidden), in the model dtype as HF
            h = h * torch.tensor(self.config.embed_scale, dtype=self.dtype)
        return h

    def kv_spec(self, page_size: int, dtype: torch.dtype | None = None) -> KVSpec:
        """The geometry of this rank's L1/L2 pools (its KV heads only): the FULL layers keep
        every page, SLIDING ones (a hybrid model's) a sidecar of the pages in their window."""
        return KVSpec(num_layers=self.config.full_layers,
                      num_kv_heads=self.layers[0].attn.num_kv_heads,
                      head_dim=self.config.head_dim, page_size=page_size, dtype=dtype or self.dtype,
                      sliding=self.config.sliding_spec())

    def _pool_layers(self, kv: KVPool, before_layer: LayerHook | None
                     ) -> list[tuple[tuple[torch.Tensor, torch.Tensor], LayerWait]]:
        """Each layer's K/V tensors and its wait: FULL layers in the pool (their loads from
        L2 waited for per layer), SLIDING ones in its sidecar (loaded before the forward)."""
        out, full, side = [], 0, 0
        for kind in self.config.layer_kinds:
            if kind is LayerKind.SLIDING:
                assert kv.sidecar is not None, "check_pool: a hybrid model's pool has a sidecar"
                out.append((kv.sidecar.slots.layer(side), _nothing))
                side += 1
            else:
                wait = partial(before_layer, full) if before_layer is not None else _nothing
                out.append((kv.layer(full), wait))
                full += 1
        return out

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
        `before_layer(l)` runs right before the attention of the pool's layer l (the l-th FULL
        layer) touches it; the pages it returns poison their readers' rows (NaN logits).
        """
        self.check_pool(kv)
        sidecar = kv.sidecar if kv.spec.sliding is not None else None  # check_pool: hybrid
        batch = ForwardBatch(seqs, kv.spec.page_size, kv.num_pages, self.device,
                             self.config.sliding_window,
                             sidecar.slot_table if sidecar is not None else None)
        if tokens.shape != (batch.num_tokens,):
            raise ConfigError(f"tokens has shape {tuple(tokens.shape)} but the sequences add up "
                              f"to {batch.num_tokens} new tokens")
        h = self.embed_tokens(tokens)
        tables = {kind: rotary.table(batch.positions, self.dtype)
                  for kind, rotary in self.rotaries.items()}
        for layer, (pool, wait) in zip(self.layers, self._pool_layers(kv, before_layer)):
            h = layer(h, *tables[layer.kind.value], batch, pool, wait)
        if not all_logits:
            h = h.index_select(0, batch.last_rows)
        return F.linear(self.norm(h), self.lm_head).float()


def _nothing() -> None:
    return None
