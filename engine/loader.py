"""Ready-to-run models: SmolLM2-135M-Instruct (converted once, cached) and the tiny test model."""
from __future__ import annotations

import os

import torch

from kvtier.engine.architectures import build_model
from kvtier.engine.model import PagedLlama
from kvtier.engine.model_config import ModelConfig, tiny_config
from kvtier.engine.parallel import SINGLE, TensorParallel
from kvtier.engine.tokenizer import Tokenizer
from kvtier.engine.weights import load_smollm2, random_state_dict


def load_smollm2_model(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                       tp: TensorParallel = SINGLE, cache_dir: str | os.PathLike | None = None
                       ) -> tuple[PagedLlama, Tokenizer]:
    """SmolLM2-135M-Instruct (this rank's shard) and its tokenizer."""
    checkpoint = load_smollm2(cache_dir)
    model = PagedLlama.from_state_dict(checkpoint.config, checkpoint.state_dict, dtype, device, tp)
    assert checkpoint.tokenizer is not None
    return model, checkpoint.tokenizer


def load_tiny_model(dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                    tp: TensorParallel = SINGLE, seed: int = 0,
                    config: ModelConfig | None = None) -> PagedLlama:
    """A random-weight model of `config` (tiny_config(), SmolLM2's architecture, unless given;
    tiny_hybrid_config() is Gemma-3's)."""
    config = config or tiny_config()
    return build_model(config, random_state_dict(config, seed), dtype, device, tp)
