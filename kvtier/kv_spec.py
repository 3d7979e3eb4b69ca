"""The shape of one rank's KV cache: what a pool needs to know about the model."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class KVSpec:
    """KV geometry of one TP rank: `num_kv_heads` is this rank's share of the heads."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "page_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"KVSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"KVSpec.dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def token_layer_elems(self) -> int:
        """Elements of K (or V) for one token in one layer."""
        return self.num_kv_heads * self.head_dim

    @property
    def page_layer_bytes(self) -> int:
        """Bytes of K (or V) for one page in one layer."""
        return self.page_size * self.token_layer_elems * self.itemsize

    @property
    def page_part_bytes(self) -> int:
        """Bytes of K (or V) for one page over all layers: one storage object."""
        return self.num_layers * self.page_layer_bytes

    @property
    def page_bytes(self) -> int:
        """Bytes of K and V for one page over all layers."""
        return 2 * self.page_part_bytes

    @property
    def token_bytes(self) -> int:
        return self.page_bytes // self.page_size


SMOLLM2_135M = dict(num_layers=30, num_kv_heads=3, head_dim=64)
