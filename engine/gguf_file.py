"""A local GGUF file as a weight source: a Llama- or Gemma-3-architecture model whose weights
the `gguf` package dequantizes, with the tokenizer and chat template its metadata carries
(Gemma's template built in: its GGUF files carry none).

The file is converted once, as SmolLM2's packaged GGUF is (kvtier.engine.weights), into
`~/.cache/kvtier/gguf/` (or `$KVTIER_CACHE_DIR/gguf/`), and loaded from there; a changed file
(another size or modification time) is converted again. What kvtier does not run (another
architecture, a sliding window on a Llama, RoPE scaling, experts, a tokenizer it cannot rebuild) is
refused by `check()`, from the file's header, before anything is converted.
`identity()` names the model and the SHA-256 of the file's bytes (hashed once, at
conversion), so two GGUF files of one architecture never share cache pages.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtier.engine.gguf_config import check_gguf_model
from kvtier.engine.model_config import Architecture, ModelConfig
from kvtier.engine.tokenizer import SpecialTokens, Tokenizer, check_gguf_tokenizer
from kvtier.engine.weights import ensure_gguf_converted, load_config, load_state_dict
from kvtier.errors import ConfigError

SUFFIX = ".gguf"


def is_gguf_path(path: str) -> bool:
    """Whether a --model value names a GGUF file (by its suffix)."""
    return path.lower().endswith(SUFFIX)


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF file; each method reads what it needs (ranks call them in their process)."""

    path: str
    cache_dir: str | None = None  # None: $KVTIER_CACHE_DIR, else ~/.cache/kvtier

    def check(self) -> None:
        """Refuse, naming the reason, a file kvtier cannot run; reads the header only."""
        from kvtier.engine.gguf_source import hf_name, read_header

        path = Path(self.path).expanduser()
        if not path.is_file():
            raise ConfigError(f"{self.path}: no such GGUF file; give an existing .gguf file "
                              f"that every node can read")
        header = read_header(path)
        check_gguf_model(header.metadata)
        check_gguf_tokenizer(header.metadata)
        architecture = Architecture(header.metadata["general.architecture"])  # checked above
        for name in header.tensor_names:
            hf_name(name, architecture)  # an unknown tensor (a bias, a fused projection) is refused

    def directory(self) -> Path:
        """The converted cache directory (converting the file on first use)."""
        return ensure_gguf_converted(self.path, self.cache_dir)

    def config(self) -> ModelConfig:
        return load_config(self.directory())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, float32, by HF Llama name (a tied LM head is not there)."""
        return load_state_dict(self.directory())

    def identity(self) -> str:
        """The model part of a cache namespace: the model's name (general.name) and the first
        16 hex digits of `digest()`."""
        return f"{self.config().name}-{self.digest()[:16]}"

    def digest(self) -> str:
        """SHA-256 of the GGUF file's bytes (recorded when it was converted)."""
        return _meta(self.directory())["source_sha256"]

    def tokenizer(self) -> Tokenizer:
        """The tokenizer rebuilt from the GGUF's vocabulary and merges, with the GGUF's chat
        template (tokenizer.chat_template; none: Gemma's for a gemma3 file, else ChatML)."""
        from kvtier.engine.chat_template import ChatTemplate

        directory = self.directory()
        meta = _meta(directory)
        template = meta.get("chat_template")
        return Tokenizer.load(directory / "tokenizer.json",
                              SpecialTokens.from_dict(meta["tokenizer"]),
                              ChatTemplate(template["source"], template["special_tokens"])
                              if template else None)


def _meta(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text())
