"""Which pages a vLLM engine may share: the key namespace of its blocks.

A vLLM block holds the attention backend's own bytes (its write routine depends on the CPU's
instruction set or the GPU's kernels), so the fingerprint holds everything that changes them:
the engine and its version, the attention backend, the ISA or device, the KV dtype, the block
size and the model's shape. The model part is the checkpoint's identity (a digest of its
weight files, as kvtier's engine names a Hugging Face directory), so vLLM blocks and pages of
kvtier's own engine never share a key, nor do two checkpoints of one architecture.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from kvtier.engine.hf_dir import HFModelDir
from kvtier.keys import KeyNamespace

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

    def fingerprint(self) -> str:
        parts = [FORMAT, self.engine, self.attention_backend, self.device, self.kv_dtype,
                 str(self.block_size), str(self.num_layers), str(self.total_kv_heads),
                 str(self.head_dim)]
        return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def model_identity(model: str) -> str:
    """A local checkpoint directory: its name and the first 16 hex digits of its weights'
    digest; a hub name: itself (its weights are whatever that name resolves to)."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.resolve().name).strip("-.") or "model"
        return f"{name}-{HFModelDir(str(path)).digest()[:16]}"
    return model


def block_namespace(model: str, identity: BlockIdentity) -> KeyNamespace:
    return KeyNamespace(model=model_identity(model), layout_fingerprint=identity.fingerprint())
