"""The architecture of a decoder model (Llama-style or Gemma-3): one frozen record, read from
GGUF metadata or JSON."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from kvtier.errors import ConfigError
from kvtier.policies import _Choice


class Architecture(_Choice):
    """Which decoder layer the model stacks (kvtier.engine.architectures builds it)."""

    LLAMA = "llama"  # pre-norm, SwiGLU, one RoPE, full attention (SmolLM2, Llama, Qwen2)
    GEMMA3 = "gemma3"  # sandwich norms, q/k norms, GELU-tanh, sliding-window layers


class LayerKind(_Choice):
    """What keys a layer's attention sees."""

    FULL = "full"  # every earlier position
    SLIDING = "sliding"  # only the last `sliding_window` positions (itself included)


class NormStyle(_Choice):
    """How an RMSNorm applies its weight."""

    PLAIN = "plain"  # w * x, x cast back to the model dtype first (Llama)
    OFFSET = "offset"  # x * (1 + w) in float32, then cast (Gemma)


class Activation(_Choice):
    """The gated MLP's activation."""

    SILU = "silu"  # SwiGLU
    GELU_TANH = "gelu_tanh"  # GeGLU with the tanh approximation (Gemma)


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and constants of the whole (unsharded) model; TP shards derive from it."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    max_position: int = 2048
    name: str = "llama"
    attention_bias: bool = False  # q/k/v projections with a bias (Qwen2)
    architecture: Architecture = Architecture.LLAMA
    layer_kinds: tuple[LayerKind, ...] = ()  # one per layer; () = every layer FULL
    sliding_window: int = 0  # keys a SLIDING layer sees (0: no sliding layer)
    rope_local_theta: float | None = None  # RoPE base of SLIDING layers (None: rope_theta)
    norm_style: NormStyle = NormStyle.PLAIN
    activation: Activation = Activation.SILU
    embed_scale: float = 1.0  # embeddings are multiplied by it (Gemma: sqrt(hidden_size))
    attention_scale: float | None = None  # softmax scale (None: head_dim ** -0.5)
    qk_norm: bool = False  # an RMSNorm per head on q and k before RoPE (Gemma-3)

    def __post_init__(self) -> None:
        for f in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                  "intermediate_size", "vocab_size", "max_position"):
            value = getattr(self, f)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"ModelConfig.{f} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of "
                              f"num_kv_heads ({self.num_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        self._normalize()
        if len(self.layer_kinds) != self.num_layers:
            raise ConfigError(f"layer_kinds names {len(self.layer_kinds)} layers but the model "
                              f"has {self.num_layers}; give one kind per layer")
        if LayerKind.SLIDING in self.layer_kinds and self.sliding_window < 1:
            raise ConfigError(f"sliding layers need sliding_window >= 1, got "
                              f"{self.sliding_window}")
        if self.architecture is Architecture.LLAMA and LayerKind.SLIDING in self.layer_kinds:
            raise ConfigError("the llama architecture has no sliding-window layers; use "
                              "architecture gemma3 or make every layer full")

    def _normalize(self) -> None:
        """Enums from their JSON spellings; () layer kinds become one FULL per layer."""
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        set_("architecture", Architecture.parse(self.architecture, "architecture"))
        set_("norm_style", NormStyle.parse(self.norm_style, "norm_style"))
        set_("activation", Activation.parse(self.activation, "activation"))
        kinds = self.layer_kinds or (LayerKind.FULL,) * self.num_layers
        set_("layer_kinds", tuple(LayerKind.parse(k, "layer_kinds") for k in kinds))

    @property
    def scale(self) -> float:
        """The attention softmax scale."""
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        """Indices of the SLIDING layers (their KV past the window is never read)."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k is LayerKind.SLIDING)

    def rope_theta_of(self, kind: LayerKind) -> float:
        if kind is LayerKind.SLIDING and self.rope_local_theta is not None:
            return self.rope_local_theta
        return self.rope_theta

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "ModelConfig":
        """Build from `to_dict()` output; unknown keys are an error (a stale or foreign file)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown model config keys {unknown}; delete the converted "
                              f"model cache so it is rebuilt")
        return cls(**data)


def tiny_config(vocab_size: int = 256, num_layers: int = 2) -> ModelConfig:
    """SmolLM2's architecture in miniature: 12 query / 6 KV heads of 8 dims, hidden 96 and
    intermediate 192, so TP 1, 2, 3 and 6 all split it (SmolLM2-135M's 3 KV heads allow only
    TP 1 and 3)."""
    return ModelConfig(hidden_size=96, num_layers=num_layers, num_heads=12, num_kv_heads=6,
                       head_dim=8, intermediate_size=192, vocab_size=vocab_size,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       max_position=4096, name="tiny")


def tiny_hybrid_config(vocab_size: int = 256, num_layers: int = 4,
                       sliding_window: int = 40) -> ModelConfig:
    """Gemma-3's architecture in miniature: layers sliding except every third (the real model:
    every sixth), a 40-token window (2.5 pages of 16), 4 query / 2 KV heads of 16 dims, so
    TP 1 and 2 split it (Gemma-3 270M's one KV head allows only TP 1). The attention scale
    differs from head_dim ** -0.5, as Gemma's query_pre_attn_scalar may."""
    kinds = tuple(LayerKind.FULL if (i + 1) % 3 == 0 else LayerKind.SLIDING
                  for i in range(num_layers))
    return ModelConfig(hidden_size=64, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=128, vocab_size=vocab_size,
                       rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                       max_position=4096, name="tiny-hybrid", architecture=Architecture.GEMMA3,
                       layer_kinds=kinds, sliding_window=sliding_window,
                       rope_local_theta=10000.0, norm_style=NormStyle.OFFSET,
                       activation=Activation.GELU_TANH, embed_scale=64 ** 0.5,
                       attention_scale=0.2, qk_norm=True)
