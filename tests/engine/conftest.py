"""Shared engine fixtures: SmolLM2 (converted once into the user's cache) and the tiny model."""
from __future__ import annotations

import os
from typing import Callable

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a model hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from kvtier.engine import PagedLlama, load_smollm2, load_tiny_model  # noqa: E402
from kvtier.engine.weights import Checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def smollm2() -> Checkpoint:
    """Converts the packaged GGUF on first use (~12 s), then loads from the cache (<1 s)."""
    return load_smollm2()


@pytest.fixture(scope="session")
def smollm2_model(smollm2: Checkpoint) -> Callable[[torch.dtype], PagedLlama]:
    """`smollm2_model(dtype)`: built on first request per dtype, then shared."""
    models: dict[torch.dtype, PagedLlama] = {}

    def get(dtype: torch.dtype) -> PagedLlama:
        if dtype not in models:
            models[dtype] = PagedLlama.from_state_dict(smollm2.config, smollm2.state_dict,
                                                       dtype, "cpu")
        return models[dtype]

    return get


@pytest.fixture(scope="session")
def tiny_models() -> dict[torch.dtype, PagedLlama]:
    return {dtype: load_tiny_model(dtype, "cpu") for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="session")
def gemma3():
    """Gemma-3 270M's (config, float32 state dict, tokenizer): assembled and converted on
    first use (~30 s), then loaded from the cache (~2 s)."""
    from kvtier.engine.gemma3_package import Gemma3Weights

    source = Gemma3Weights()
    return source.config(), source.state_dict(), source.tokenizer()


@pytest.fixture(scope="session")
def gemma3_model(gemma3):
    """The float32 PagedGemma3 (built once per session)."""
    from kvtier.engine.architectures import build_model

    config, state, _ = gemma3
    return build_model(config, state, torch.float32, "cpu")


@pytest.fixture(scope="session")
def gemma3_tokenizer():
    """Gemma-3 270M's tokenizer alone (the weights converted on first use)."""
    from kvtier.engine.gemma3_package import Gemma3Weights

    return Gemma3Weights().tokenizer()


@pytest.fixture(scope="session")
def tiny_hybrid_models():
    """Gemma-3's architecture in miniature (tiny_hybrid_config: a 40-token window), fp32 and
    bf16."""
    from kvtier.engine.model_config import tiny_hybrid_config

    return {dtype: load_tiny_model(dtype, "cpu", config=tiny_hybrid_config())
            for dtype in (torch.float32, torch.bfloat16)}
