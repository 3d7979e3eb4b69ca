"""Which pages a vLLM engine may share: the key namespace of its blocks.

A vLLM block holds the attention backend's own bytes (its write routine depends on the CPU's
instruction set or the GPU's kernels), so the fingerprint holds everything that changes them:
the engine and its version, the attention backend, the ISA or device, the KV dtype, the block
size, the model's shape, and how the engine computes from the checkpoint (`config_digest`:
revision, resolved config with overrides, dtype, quantization, KV cache dtype). The model part is the checkpoint's identity (a digest of its
weight files, as kvtier's engine names a Hugging Face directory), so vLLM blocks and pages of
kvtier's own engine never share a key, nor do two checkpoints of one architecture.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.engine.hf_dir import HFModelDir
from kvtier.keys import KeyNamespace, model_part

FORMAT = "vllm-block-v1"  # one object per page, KV head and part (K, V), layers inside


@dataclass(frozen=True)
class BlockIdentity:
    engine: str  # e.g. "vllm 0.32.0"
    attention_backend: str  # e.g. "CPU_ATTN"
    device: str  # the CPU's ISA ("avx2") or the GPU's compute capability ("cuda-sm90")
    kv_dtype: str
    block_size: int
    num_layers: int
    total_kv_heads: int
    head_dim: int
    config: str = ""  # `config_digest`: how the engine computes from the checkpoint

    def fingerprint(self) -> str:
        parts = [FORMAT, self.engine, self.attention_backend, self.device, self.kv_dtype,
                 str(self.block_size), str(self.num_layers), str(self.total_kv_heads),
                 str(self.head_dim), self.config]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def config_digest(model_config: Any, cache_config: Any) -> str:
    """A digest of what, besides the weight files and the shapes, decides a block's bytes: the
    checkpoint's config.json (its weights' digest is the namespace's model part) and revision
    (a hub name resolves to other weights at another revision), the engine's config overrides
    (`hf_overrides`, `hf_config_path`: rope scaling and the like), the compute
    dtype, quantization, and the KV cache dtype with the layers it skips (fp8 scales come
    with the checkpoint: run-time scales are refused, kvtier.connector.supported). Only what
    every process of the engine has alike before loading the model: a config the loader
    changes in a worker would key that worker's pages apart from its scheduler's."""
    overrides = getattr(model_config, "hf_overrides", None) or {}
    if callable(overrides):  # a function rewriting the config: known by its name
        overrides = f"{getattr(overrides, '__module__', '')}.{overrides.__qualname__}"
    config_json = Path(str(getattr(model_config, "model", ""))).expanduser() / "config.json"
    parts = {
        "config_json": hashlib.sha256(config_json.read_bytes()).hexdigest()
        if config_json.is_file() else None,
        "revision": getattr(model_config, "revision", None),
        "config_path": getattr(model_config, "hf_config_path", None),
        "overrides": overrides,
        "dtype": str(getattr(model_config, "dtype", "")),
        "quantization": getattr(model_config, "quantization", None),
        "model_impl": str(getattr(model_config, "model_impl", "")),
        "cache_dtype": str(getattr(cache_config, "cache_dtype", "")),
        "skip_layers": list(getattr(cache_config, "kv_cache_dtype_skip_layers", None) or []),
    }
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def model_identity(model: str) -> str:
    """A local checkpoint directory: its name and the first 16 hex digits of its weights'
    digest, as kvtier's engine names the same directory (`HFModelDir.identity`); a hub name:
    itself (its weights are whatever that name resolves to)."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return model_part(HFModelDir(str(path)).identity())
    return model


def block_namespace(model: str, identity: BlockIdentity) -> KeyNamespace:
    return KeyNamespace(model=model_identity(model), layout_fingerprint=identity.fingerprint())
