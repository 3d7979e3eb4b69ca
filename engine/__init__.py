"""The reference engine: paged Llama-style (SmolLM2-135M-Instruct) and Gemma-3 (270M) models
over kvtier's cache hierarchy; `Engine` schedules requests over them (continuous batching).
"""
from kvtier.engine.architectures import build_model
from kvtier.engine.batch import SeqChunk
from kvtier.engine.engine import Engine
from kvtier.engine.loader import load_smollm2_model, load_tiny_model
from kvtier.engine.gemma3 import PagedGemma3
from kvtier.engine.model import PagedLlama
from kvtier.engine.model_config import (Architecture, LayerKind, ModelConfig, tiny_config,
                                        tiny_hybrid_config)
from kvtier.engine.parallel import TensorParallel
from kvtier.engine.request import CachedTokens, FinishReason, Output, RequestState
from kvtier.engine.runner import ModelRunner, chunk_bounds
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.engine.scheduler import Scheduler, StepStats
from kvtier.engine.tokenizer import Tokenizer, apply_chat_template
from kvtier.engine.weights import ensure_converted, load_smollm2, model_dir, random_state_dict

__all__ = [
    "Architecture", "LayerKind", "PagedGemma3", "build_model", "tiny_hybrid_config",
    "CachedTokens", "Engine", "FinishReason", "Output", "RequestState", "Scheduler", "StepStats",
    "ModelConfig", "ModelRunner", "PagedLlama", "Sampler", "SamplingParams",
    "SeqChunk", "TensorParallel", "Tokenizer", "apply_chat_template", "chunk_bounds",
    "ensure_converted", "load_smollm2", "load_smollm2_model", "load_tiny_model",
    "model_dir", "random_state_dict", "tiny_config",
]
