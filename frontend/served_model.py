"""What a deployment's ranks load and its ingress tokenizes with, from its settings: SmolLM2
(the embedded default), Gemma-3 270M, the tiny test model (random weights over SmolLM2's
vocabulary), a Hugging Face model directory or a GGUF file."""
from __future__ import annotations

from typing import Any

from kvtier.frontend.settings import ModelChoice, ServeSettings


def weight_source(s: ServeSettings) -> Any:
    """The ranks' WeightSource (kvtier.engine.weight_sources); ranks rebuild it from its
    record (engine/weight_source_record.py) and load it."""
    from kvtier.engine.local_model import local_model
    from kvtier.engine.model_config import tiny_config
    from kvtier.engine.weight_sources import SmolLM2Weights, TinyWeights

    from kvtier.engine.gemma3_package import Gemma3Weights

    if s.model is ModelChoice.PATH:
        return local_model(s.model_path)
    if s.model is ModelChoice.GEMMA3_270M:
        return Gemma3Weights()
    smol = SmolLM2Weights()
    if s.model is ModelChoice.SMOLLM2:
        return smol
    return TinyWeights(seed=0, model_config=tiny_config(vocab_size=smol.config().vocab_size))


def tokenizer(s: ServeSettings) -> Any:
    """The model's Tokenizer (kvtier.engine.tokenizer): its chat template and stop tokens."""
    from kvtier.engine.local_model import local_model
    from kvtier.engine.tokenizer import Tokenizer
    from kvtier.engine.weights import ensure_converted

    from kvtier.engine.gemma3_package import Gemma3Weights

    if s.model is ModelChoice.PATH:
        return local_model(s.model_path).tokenizer()
    if s.model is ModelChoice.GEMMA3_270M:
        return Gemma3Weights().tokenizer()
    return Tokenizer.from_files(ensure_converted())  # SmolLM2's, the tiny model's too
