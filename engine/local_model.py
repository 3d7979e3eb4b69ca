"""A model on local disk, by path: a GGUF file (`*.gguf`) or a Hugging Face model directory."""
from __future__ import annotations

from kvtier.engine.gguf_file import GGUFFile, is_gguf_path
from kvtier.engine.hf_dir import HFModelDir


def local_model(path: str) -> GGUFFile | HFModelDir:
    """The weight source at `path` (config(), state_dict(), tokenizer(), identity())."""
    return GGUFFile(path) if is_gguf_path(path) else HFModelDir(path)
