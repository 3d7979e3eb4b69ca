"""The shape of one rank's KV cache: what a pool needs to know about the model."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError


def _check_positive(owner: str, obj: object, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{owner}.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class SlidingSpec:
    """The sliding-window layers of a hybrid model. Their KV lives in a sidecar pool next to
    the full-attention layers' pool, and only for the pages a query can still see."""

    num_layers: int  # sliding-window layers (the pool's `num_layers` counts the others)
    window: int  # keys a query sees, itself included: key k is seen from q while q - k < window

    def __post_init__(self) -> None:
        _check_positive("SlidingSpec", self, ("num_layers", "window"))

    def window_pages(self, page_size: int) -> int:
        """Pages before position n*page_size that the query at that position sees (partly or
        whole): what a hit ending after n pages needs of the sliding layers."""
        return max(1, -(-(self.window - 1) // page_size))


@dataclass(frozen=True)
class KVSpec:
    """KV geometry of one TP rank: `num_kv_heads` is this rank's share of the heads.

    `num_layers` counts the layers whose KV is kept for every page (all layers of a plain
    model); a hybrid model's sliding-window layers are described by `sliding`."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype = torch.bfloat16
    sliding: SlidingSpec | None = None

    def __post_init__(self) -> None:
        _check_positive("KVSpec", self, ("num_layers", "num_kv_heads", "head_dim", "page_size"))
        if not isinstance(self.dtype, torch.dtype):
            raise ConfigError(f"KVSpec.dtype must be a torch.dtype, got {self.dtype!r}")
        if self.sliding is not None and not isinstance(self.sliding, SlidingSpec):
            raise ConfigError(f"KVSpec.sliding must be a SlidingSpec or None, got "
                              f"{self.sliding!r}")

    @property
    def sidecar(self) -> "KVSpec | None":
        """The geometry of the sliding-window layers' pool (None: no such layers)."""
        if self.sliding is None:
            return None
        return KVSpec(self.sliding.num_layers, self.num_kv_heads, self.head_dim,
                      self.page_size, self.dtype)

    @property
    def window_pages(self) -> int:
        """Trailing pages of a hit that need sliding-window KV (0: none do)."""
        return 0 if self.sliding is None else self.sliding.window_pages(self.page_size)

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


MAX_KV_HEADS = 1024  # object names carry a head index in at most 4 digits


@dataclass(frozen=True)
class HeadRange:
    """The KV heads `[start, stop)` one TP rank owns, out of the model's `total` KV heads.

    L3 stores a page as one object per KV head (and part), named by the GLOBAL head index,
    so a rank of any TP size reads and writes exactly its heads: TP rank r of size t owns
    heads [r*H/t, (r+1)*H/t)."""

    start: int
    stop: int
    total: int

    def __post_init__(self) -> None:
        for name in ("start", "stop", "total"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(f"HeadRange.{name} must be an int, got {value!r}")
        if not 0 <= self.start < self.stop <= self.total <= MAX_KV_HEADS:
            raise ConfigError(f"bad KV head range [{self.start}, {self.stop}) of {self.total} "
                              f"heads: need 0 <= start < stop <= total <= {MAX_KV_HEADS}")

    @classmethod
    def of_rank(cls, total: int, tp_rank: int = 0, tp_size: int = 1) -> "HeadRange":
        """The heads TP rank `tp_rank` of `tp_size` owns; the size must divide `total`."""
        if not (isinstance(tp_size, int) and isinstance(tp_rank, int) and tp_size >= 1
                and 0 <= tp_rank < tp_size):
            raise ConfigError(f"bad TP rank/size {tp_rank}/{tp_size}")
        if total % tp_size:
            raise ConfigError(f"{total} KV heads do not split over TP size {tp_size}: use a "
                              "TP size that divides the model's KV heads")
        share = total // tp_size
        return cls(tp_rank * share, (tp_rank + 1) * share, total)

    @classmethod
    def all_of(cls, total: int) -> "HeadRange":
        return cls(0, total, total)

    @property
    def count(self) -> int:
        return self.stop - self.start

    def heads(self) -> range:
        """The global head indices, in order."""
        return range(self.start, self.stop)
