"""Which paged model class runs which architecture, and building one from a state dict."""
from __future__ import annotations

from typing import Mapping

import torch

from kvtier.engine.gemma3 import PagedGemma3
from kvtier.engine.model import PagedLlama
from kvtier.engine.model_config import Architecture, ModelConfig
from kvtier.engine.parallel import SINGLE, TensorParallel

MODEL_CLASSES: dict[Architecture, type[PagedLlama]] = {
    Architecture.LLAMA: PagedLlama,
    Architecture.GEMMA3: PagedGemma3,
}


def build_model(config: ModelConfig, state: Mapping[str, torch.Tensor],
                dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
                tp: TensorParallel = SINGLE) -> PagedLlama:
    """Rank `tp.rank`'s model of `config.architecture`, from the full HF-named state dict."""
    return MODEL_CLASSES[config.architecture].from_state_dict(config, state, dtype, device, tp)
