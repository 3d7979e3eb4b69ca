"""A model on local disk, by path: a GGUF file (`*.gguf`) or a Hugging Face model directory;
or a packaged one by alias (gemma3-270m)."""
from __future__ import annotations

from kvtier.engine.gemma3_package import ALIAS as GEMMA3_ALIAS, Gemma3Weights
from kvtier.engine.gguf_file import GGUFFile, is_gguf_path
from kvtier.engine.hf_dir import HFModelDir


def local_model(path: str) -> GGUFFile | HFModelDir:
    """The weight source at `path` (config(), state_dict(), tokenizer(), identity())."""
    return GGUFFile(path) if is_gguf_path(path) else HFModelDir(path)


def model_source(name: str) -> GGUFFile | HFModelDir | Gemma3Weights:
    """Gemma-3 270M for its alias (gemma3-270m), else the model at path `name`."""
    if name.strip().lower().replace("_", "-") == GEMMA3_ALIAS:
        return Gemma3Weights()
    return local_model(name)
