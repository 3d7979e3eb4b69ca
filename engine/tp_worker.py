"""The rank side of TP generation: load this rank's shard, generate over its own L1 pool.

`generate_on_rank(tp, source, ...)` is what one rank runs (in a `run_tp` process now, in a Ray
actor in part 4); `tp_generate` launches a whole local group and returns rank 0's answer.
Weights are named by a small picklable `WeightSource` and loaded inside each rank, so no
process ships a full state dict to another.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol, Sequence

import torch

from kvtier.engine.generate import generate
from kvtier.engine.architectures import build_model
from kvtier.engine.model_config import ModelConfig, tiny_config
from kvtier.engine.parallel import TensorParallel
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.tp_group import DEFAULT_TIMEOUT_S, TPRunError, rank_device, run_tp
from kvtier.engine.weights import ensure_converted, load_config, load_smollm2, random_state_dict

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    """Where a rank gets the full (unsharded) weights; must pickle cheaply."""

    def config(self) -> ModelConfig: ...

    def state_dict(self) -> dict[str, torch.Tensor]: ...


@dataclass(frozen=True)
class TinyWeights:
    """Random weights from `seed` (the same on every rank): tests and TP sizes 135M can't split."""

    seed: int = 0
    model_config: ModelConfig = field(default_factory=tiny_config)

    def config(self) -> ModelConfig:
        return self.model_config

    def state_dict(self) -> dict[str, torch.Tensor]:
        return random_state_dict(self.model_config, self.seed)


@dataclass(frozen=True)
class SmolLM2Weights:
    """SmolLM2-135M-Instruct from the converted cache (converted once; ranks share a lock)."""

    cache_dir: str | None = None

    def config(self) -> ModelConfig:
        return load_config(ensure_converted(self.cache_dir))

    def state_dict(self) -> dict[str, torch.Tensor]:
        return load_smollm2(self.cache_dir, with_tokenizer=False).state_dict


@dataclass(frozen=True)
class RankGeneration:
    """One rank's result: its share of the KV heads and the tokens it generated."""

    rank: int
    size: int
    num_kv_heads: int                   # KV heads in this rank's pool: total / size
    tokens: list[list[int]]             # per prompt
    finish_reasons: list[str]


def generate_on_rank(tp: TensorParallel, source: WeightSource, prompts: Sequence[Sequence[int]],
                     params: SamplingParams = SamplingParams(), dtype: torch.dtype = torch.float32,
                     page_size: int = 16, chunk_tokens: int | None = None) -> RankGeneration:
    """Build rank `tp.rank`'s shard and run `generate` on it; every rank of the group must call
    this with the same arguments (each forward is a sequence of all-reduces across ranks)."""
    model = build_model(source.config(), source.state_dict(), dtype, rank_device(), tp)
    gens = generate(model, prompts, params, page_size=page_size, chunk_tokens=chunk_tokens)
    return RankGeneration(tp.rank, tp.size, model.kv_spec(page_size).num_kv_heads,
                          [g.tokens for g in gens], [g.finish_reason for g in gens])


def tp_generate(source: WeightSource, prompts: Sequence[Sequence[int]], size: int,
                params: SamplingParams = SamplingParams(), dtype: torch.dtype = torch.float32,
                page_size: int = 16, chunk_tokens: int | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> RankGeneration:
    """Generate with `size` local rank processes; rank 0's result (all ranks must agree)."""
    prompts = [list(p) for p in prompts]
    results: list[RankGeneration] = run_tp(
        generate_on_rank, size, source, prompts, params, dtype, page_size, chunk_tokens,
        timeout_s=timeout_s, config=source.config())
    for other in results[1:]:
        if other.tokens != results[0].tokens:
            # All-reduce hands every rank the same bits, so ranks can only diverge by a bug.
            raise TPRunError(f"TP rank {other.rank} generated {other.tokens}, rank 0 "
                             f"{results[0].tokens}: the ranks' models are out of step",
                             other.rank)
    return results[0]
