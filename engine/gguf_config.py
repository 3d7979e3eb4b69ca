"""A GGUF file's model config: the `llama` and `gemma3` architectures' metadata keys read into
one ModelConfig, and what kvtier does not run refused by name before anything is converted.

Gemma-3 GGUFs (llama.cpp's converter) carry neither the layer pattern nor the sliding layers'
RoPE base nor the attention scale: llama.cpp hard-codes them, and so does this module (every
sixth layer global, local base 10,000, scale head_dim ** -0.5 as query_pre_attn_scalar is for
every Gemma-3 size but 27B, which is refused by name).
"""
from __future__ import annotations

from typing import Any, Mapping

from kvtier.engine.model_config import (Activation, Architecture, LayerKind, ModelConfig,
                                        NormStyle)
from kvtier.errors import ConfigError

GEMMA3_GLOBAL_EVERY = 6  # layer i is global when (i + 1) % 6 == 0
GEMMA3_LOCAL_THETA = 10000.0
GEMMA3_27B_HIDDEN = 5376  # its query_pre_attn_scalar is hidden / heads, not head_dim


def check_gguf_model(meta: Mapping[str, Any]) -> None:
    """Refuse, naming it, a GGUF kvtier does not run: another architecture, a sliding window
    on a llama, RoPE scaling, experts (MoE), Gemma-3 27B."""
    arch = meta.get("general.architecture")
    if arch not in (a.value for a in Architecture):
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; kvtier runs "
                          f"{', '.join(repr(a.value) for a in Architecture)} GGUF files")
    if arch == "llama" and meta.get("llama.attention.sliding_window"):
        raise ConfigError(f"the GGUF asks for sliding-window attention on a llama (llama."
                          f"attention.sliding_window={meta['llama.attention.sliding_window']}),"
                          f" which kvtier does not run; use a full-attention model or Gemma-3")
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none") and meta.get(f"{arch}.rope.scaling.factor") != 1.0:
        raise ConfigError(f"RoPE scaling ({scaling}) is not supported; kvtier runs plain RoPE")
    if meta.get(f"{arch}.expert_count"):
        raise ConfigError(f"the GGUF is a mixture of experts ({meta[f'{arch}.expert_count']} "
                          f"experts), which kvtier does not run; use a dense model")
    if arch == "gemma3":
        if meta.get("gemma3.embedding_length") == GEMMA3_27B_HIDDEN:
            raise ConfigError("Gemma-3 27B scales attention by hidden/heads, which kvtier does "
                              "not run yet; use another Gemma-3 size")
        if meta.get("gemma3.attention.key_length") != meta.get("gemma3.attention.value_length"):
            raise ConfigError("the GGUF's key and value lengths differ, which kvtier does not "
                              "run; use a model whose keys and values share one head size")


def config_from_gguf(meta: Mapping[str, Any], has_output_weight: bool) -> ModelConfig:
    """The ModelConfig of a GGUF's metadata (values already decoded)."""
    check_gguf_model(meta)
    arch = Architecture(meta["general.architecture"])

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch.value}.{name}", default)
        if value is None:
            raise ConfigError(f"GGUF metadata lacks {arch.value}.{name}; the file is incomplete")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    layers = int(key("block_count"))
    vocab = meta.get(f"{arch.value}.vocab_size") or len(meta["tokenizer.ggml.tokens"])
    common = dict(
        hidden_size=hidden, num_layers=layers, num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        intermediate_size=int(key("feed_forward_length")), vocab_size=int(vocab),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        # GGUF drops output.weight when the LM head is the embedding matrix.
        tie_word_embeddings=not has_output_weight,
        max_position=int(key("context_length")), name=str(meta.get("general.name", arch.value)),
        architecture=arch)
    if arch is Architecture.LLAMA:
        return ModelConfig(head_dim=int(key("rope.dimension_count", hidden // heads)), **common)
    head_dim = int(key("attention.key_length"))
    pattern = meta.get("gemma3.attention.sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
    if isinstance(pattern, (list, tuple)):  # newer converters: one flag per layer
        kinds = tuple(LayerKind.SLIDING if flag else LayerKind.FULL for flag in pattern)
    else:
        kinds = tuple(LayerKind.FULL if (i + 1) % int(pattern) == 0 else LayerKind.SLIDING
                      for i in range(layers))
    return ModelConfig(head_dim=head_dim, layer_kinds=kinds,
                       sliding_window=int(key("attention.sliding_window")),
                       rope_local_theta=GEMMA3_LOCAL_THETA, norm_style=NormStyle.OFFSET,
                       activation=Activation.GELU_TANH, embed_scale=hidden ** 0.5,
                       attention_scale=head_dim ** -0.5, qk_norm=True, **common)
