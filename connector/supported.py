"""What KvtierConnector can key and move, checked before vLLM builds anything with it: the
engine settings it refuses at start, each with an error that names the setting.

A page's key says which tokens it holds, under a namespace that says whose model computed
them in which byte layout (kvtier.connector.identity). Some vLLM layouts put more than that
in a block, or split one page over processes the connector does not tell apart, and a key
cannot say so; sharing such blocks would hand one process another's KV. They are refused:

- pipeline parallelism: each stage holds its own layers of a block, and L3 objects, peer
  contacts and the ranks' fetch reports are told apart by TP rank only, so two stages would
  write the same objects and a stage would load the other's layers;
- decode and prefill context parallelism: a block's tokens are interleaved over the ranks;
- attention other than full attention over one KV cache group (hybrid, sliding-window and
  MLA caches, packed quantized layouts);
- KV scales computed at run time (fp8 scales measured on an engine's first batches): two
  engines' blocks of the same tokens differ.
See docs/vllm.md, "What the connector refuses".
"""
from __future__ import annotations

from typing import Any

from kvtier.connector.settings import CONNECTOR
from kvtier.errors import ConfigError


def refuse_unsupported(vllm_config: Any) -> None:
    """Raise ConfigError when `vllm_config` runs a layout the connector cannot key."""
    parallel = vllm_config.parallel_config
    for name, why in (
            ("pipeline_parallel_size", "each stage holds its own layers of a block, and "
             "kvtier tells ranks apart by TP rank only"),
            ("decode_context_parallel_size", "a block's tokens are spread over the ranks"),
            ("prefill_context_parallel_size", "a block's tokens are spread over the ranks")):
        size = getattr(parallel, name, 1) or 1
        if size > 1:
            raise ConfigError(f"{CONNECTOR} does not support {name}={size} ({why}): run the "
                              f"engine with {name}=1 (tensor parallelism is supported), or "
                              f"without the connector")
    cache = vllm_config.cache_config
    if getattr(cache, "calculate_kv_scales", False):
        raise ConfigError(f"{CONNECTOR} does not support calculate_kv_scales: KV scales "
                          f"measured on each engine's first batches make two engines' blocks "
                          f"of the same tokens differ; take the scales from the checkpoint "
                          f"(calculate_kv_scales off) or run without the connector")


def refuse_unsupported_spec(groups: Any) -> Any:
    """The one KV cache spec of `groups` (vLLM's kv_cache_groups); ConfigError unless it is
    plain full attention in every layer, one KV head per head slot."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if len(groups) != 1:
        raise ConfigError(f"{CONNECTOR} needs a model with one KV cache group (full "
                          f"attention in every layer); this one has {len(groups)}. "
                          f"Hybrid models are not supported yet: run vLLM without it")
    spec = groups[0].kv_cache_spec
    kind = type(spec).__name__
    if not isinstance(spec, FullAttentionSpec) or isinstance(spec, MLAAttentionSpec):
        raise ConfigError(f"{CONNECTOR} moves full-attention KV caches; this model's is "
                          f"{kind}: run vLLM without the connector")
    if getattr(spec, "num_head_slots", None) is not None or \
            getattr(spec, "state_content_bytes", None) is not None:
        raise ConfigError(f"{CONNECTOR} moves one slot per KV head; this engine packs its KV "
                          f"cache ({kind} with kv_cache_dtype "
                          f"{getattr(spec, 'kv_quant_mode', '?')!s}): use an unpacked "
                          f"kv_cache_dtype or run vLLM without the connector")
    return spec
