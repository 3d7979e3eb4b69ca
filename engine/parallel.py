"""Tensor parallelism of the model: which rank holds which heads, and the all-reduce hook.

Megatron-style: QKV and gate/up are split by output rows (column-parallel), o_proj and
down_proj by input columns (row-parallel) and their partial outputs are summed across ranks.
Each rank keeps whole KV heads, so its L1 pool holds only its KV shard. Embeddings, norms and
the LM head are replicated (at 135M they are small; a vocab-parallel head can come later).
At TP=1 every hook here is a no-op and no `torch.distributed` state is needed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvtier.engine.model_config import ModelConfig
from kvtier.errors import ConfigError


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its TP group.

    `reduce_fn` (in-place sum over ranks) overrides the default `torch.distributed.all_reduce`
    on `group`; tests use it to run ranks as threads.
    """

    rank: int = 0
    size: int = 1
    group: Any = None
    reduce_fn: Callable[[torch.Tensor], None] | None = None

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"TP rank {self.rank} is not in [0, {self.size}); "
                              f"give 0 <= tp_rank < tp_size")

    def check(self, config: ModelConfig) -> None:
        """Raise unless `config` splits evenly over `size` ranks."""
        for what, count in (("KV heads", config.num_kv_heads), ("query heads", config.num_heads),
                            ("intermediate size", config.intermediate_size)):
            if count % self.size:
                raise ConfigError(f"TP size {self.size} does not divide the {count} {what} of "
                                  f"{config.name!r}; choose a TP size that divides "
                                  f"{config.num_kv_heads} (or use tiny_config() for tests)")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over ranks in place (row-parallel outputs); returns `x`."""
        if self.size == 1:
            return x
        if self.reduce_fn is not None:
            self.reduce_fn(x)
        else:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def local_heads(self, config: ModelConfig) -> tuple[int, int]:
        """(query heads, KV heads) this rank computes and caches."""
        self.check(config)
        return config.num_heads // self.size, config.num_kv_heads // self.size

    def local_intermediate(self, config: ModelConfig) -> int:
        return config.intermediate_size // self.size

    def rows(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's block of output rows (column-parallel layer)."""
        n = weight.shape[0] // self.size
        return weight[self.rank * n:(self.rank + 1) * n]

    def cols(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's block of input columns (row-parallel layer)."""
        n = weight.shape[1] // self.size
        return weight[:, self.rank * n:(self.rank + 1) * n]


SINGLE = TensorParallel()
