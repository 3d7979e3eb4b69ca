"""The L1 pool: one rank's KV pages in the tensor attention reads."""
from __future__ import annotations

import logging

import torch

from kvtier.errors import ClosedError, ConfigError
from kvtier.kv_spec import KVSpec
from kvtier.tiers.allocator import PageAllocator
from kvtier.tiers.sidecar import DEVICE_SLOT_FRACTION, Sidecar, sidecar_slots

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


class DevicePool:
    """`kv` has shape (2, L, num_pages, page_size, H, D): part (K=0, V=1), layer, page, token.

    Zero-filled, because attention over a partly filled page must not meet NaN garbage.
    """

    def __init__(self, spec: KVSpec, num_pages: int, device: torch.device | str | None = None,
                 slots: int | None = None) -> None:
        """A hybrid model's spec (`spec.sliding`) adds a sidecar of `slots` slots for its
        sliding-window layers (None: one per page, `sidecar_slots`)."""
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(f"the device pool needs a positive page count, got {num_pages!r}")
        self.spec = spec
        self.num_pages = num_pages
        self.device = torch.device(device) if device is not None else default_device()
        shape = (2, spec.num_layers, num_pages, spec.page_size, spec.num_kv_heads, spec.head_dim)
        self._kv: torch.Tensor | None = torch.zeros(shape, dtype=spec.dtype, device=self.device)
        self.sidecar: Sidecar | None = None
        if spec.sidecar is not None:
            slot_pool = DevicePool(spec.sidecar, sidecar_slots(spec, num_pages, slots,
                                                              DEVICE_SLOT_FRACTION), self.device)
            self.sidecar = Sidecar(slot_pool, num_pages)
        self.allocator = PageAllocator(num_pages, self.sidecar.drop if self.sidecar else None)
        log.debug("L1 pool: %d pages, %.1f MiB on %s", num_pages, self.nbytes / 2**20, self.device)

    @property
    def kv(self) -> torch.Tensor:
        if self._kv is None:
            raise ClosedError("the device pool is closed; create a new DevicePool")
        return self._kv

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (its sidecar included)."""
        side = self.sidecar.slots.nbytes if self.sidecar is not None else 0
        return self.num_pages * self.spec.page_bytes + side

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, each (num_pages, page_size, H, D), as views for attention."""
        kv = self.kv
        return kv[0, layer], kv[1, layer]

    def layer_page_view(self) -> torch.Tensor:
        """(2, L, num_pages, page_size, H, D): the common view page copies index."""
        return self.kv

    def close(self) -> None:
        self._kv = None
        if self.sidecar is not None:
            self.sidecar.slots.close()

    def __enter__(self) -> "DevicePool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
