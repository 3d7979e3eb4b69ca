"""The architecture of a Llama-style model: one frozen record, read from GGUF metadata or JSON."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Mapping

from kvtier.errors import ConfigError


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

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any], has_output_weight: bool) -> "ModelConfig":
        """Read a llama-architecture GGUF's `llama.*` keys (values already decoded)."""
        check_gguf_llama(meta)

        def key(name: str, default: Any = None) -> Any:
            value = meta.get(f"llama.{name}", default)
            if value is None:
                raise ConfigError(f"GGUF metadata lacks llama.{name}; the file is incomplete")
            return value

        hidden = int(key("embedding_length"))
        heads = int(key("attention.head_count"))
        vocab = meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"])
        return cls(
            hidden_size=hidden,
            num_layers=int(key("block_count")),
            num_heads=heads,
            num_kv_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("rope.dimension_count", hidden // heads)),
            intermediate_size=int(key("feed_forward_length")),
            vocab_size=int(vocab),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
            # GGUF drops output.weight when the LM head is the embedding matrix.
            tie_word_embeddings=not has_output_weight,
            max_position=int(key("context_length")),
            name=str(meta.get("general.name", "llama")),
        )


def check_gguf_llama(meta: Mapping[str, Any]) -> None:
    """Refuse, naming it, a GGUF that is not a plain Llama: another architecture, a sliding
    window, RoPE scaling or experts (MoE)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; kvtier runs 'llama' "
                          f"GGUF files (Llama-architecture models)")
    if meta.get("llama.attention.sliding_window"):
        raise ConfigError(f"the GGUF asks for sliding-window attention (llama.attention."
                          f"sliding_window={meta['llama.attention.sliding_window']}), which "
                          f"kvtier does not run yet; use a full-attention model")
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none") and meta.get("llama.rope.scaling.factor") != 1.0:
        raise ConfigError(f"RoPE scaling ({scaling}) is not supported; kvtier runs plain RoPE")
    if meta.get("llama.expert_count"):
        raise ConfigError(f"the GGUF is a mixture of experts ({meta['llama.expert_count']} "
                          f"experts), which kvtier does not run; use a dense model")


def tiny_config(vocab_size: int = 256, num_layers: int = 2) -> ModelConfig:
    """SmolLM2's architecture in miniature: 12 query / 6 KV heads of 8 dims, hidden 96 and
    intermediate 192, so TP 1, 2, 3 and 6 all split it (SmolLM2-135M's 3 KV heads allow only
    TP 1 and 3)."""
    return ModelConfig(hidden_size=96, num_layers=num_layers, num_heads=12, num_kv_heads=6,
                       head_dim=8, intermediate_size=192, vocab_size=vocab_size,
                       rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                       max_position=4096, name="tiny")
