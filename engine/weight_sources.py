"""Where a rank gets its model's weights: a small `WeightSource` each rank loads from itself
(its shard is cut from what it loads), so no process ships a full state dict to another."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvtier.engine.model_config import ModelConfig, tiny_config
from kvtier.engine.weights import ensure_converted, load_config, load_smollm2, random_state_dict


class WeightSource(Protocol):
    """Where a rank gets the full (unsharded) weights. A source crosses to a rank as a small
    record it is rebuilt from (engine/weight_source_record.py): each kind is named there."""

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
