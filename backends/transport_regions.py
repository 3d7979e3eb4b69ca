"""The memory an endpoint registered, and the check that a write's rows lie inside it.

A transport write names its bytes as rows `(addr, nbytes)` of a uint64 array of shape (n, 2).
`RegionTable.locate` finds, for every row at once (numpy, no per-row Python), the registered
region that holds it whole, or -1: a row that crosses into a neighbouring region or past the
end is not inside any, because no library can move it as one descriptor.
"""
from __future__ import annotations

import re
from typing import Iterable, NamedTuple

import numpy as np

from kvtier.errors import CacheUsageError, ConfigError

_DEVICE = re.compile(r"^(cpu|cuda:(\d+))$")


class Region(NamedTuple):
    addr: int
    nbytes: int
    device: str  # "cpu" or "cuda:N"


def parse_device(device: str) -> tuple[str, int]:
    """("cpu", 0) or ("cuda", N) from "cpu" / "cuda" / "cuda:N"."""
    text = str(device).strip().lower()
    text = "cuda:0" if text == "cuda" else text
    match = _DEVICE.match(text)
    if not match:
        raise ConfigError(f"device {device!r}: register host memory as 'cpu' and GPU memory as "
                          "'cuda:N' (the GPU index the tensor lives on)")
    return ("cpu", 0) if match.group(2) is None else ("cuda", int(match.group(2)))


def as_rows(rows: np.ndarray, what: str) -> np.ndarray:
    """`rows` as a C-contiguous uint64 (n, 2) array, or CacheUsageError saying what is wrong."""
    arr = np.asarray(rows)
    if arr.ndim != 2 or arr.shape[1] != 2:
        raise CacheUsageError(f"{what} rows must have shape (n, 2) as (addr, nbytes); got "
                              f"shape {arr.shape}")
    if arr.dtype != np.uint64:
        if not np.issubdtype(arr.dtype, np.integer):
            raise CacheUsageError(f"{what} rows must be integers (uint64); got {arr.dtype}")
        if arr.size and arr.min() < 0:
            raise CacheUsageError(f"{what} rows hold a negative address or size")
    return np.ascontiguousarray(arr, dtype=np.uint64)


class RegionTable:
    """Registered regions, sorted by address, that never overlap one another."""

    def __init__(self, regions: Iterable[Region] = ()) -> None:
        self.regions: list[Region] = []
        self._starts = np.zeros(0, np.uint64)
        self._ends = np.zeros(0, np.uint64)
        self._devices: list[str] = []
        self._codes = np.zeros(0, np.int64)
        for region in regions:
            self.add(region)

    def __len__(self) -> int:
        return len(self.regions)

    def add(self, region: Region) -> bool:
        """Add `region`; False when exactly it is there already (registration is idempotent).

        A region that overlaps a different one is a caller bug (register each pool once)."""
        if region.nbytes <= 0 or region.addr <= 0:
            raise CacheUsageError(f"cannot register {region.nbytes} bytes at {region.addr:#x}: "
                                  "pass a tensor's data_ptr() and its nbytes")
        for old in self.regions:
            if old.addr == region.addr and old.nbytes == region.nbytes:
                if old.device != region.device:
                    raise CacheUsageError(f"the region at {region.addr:#x} is registered as "
                                          f"{old.device}, not {region.device}")
                return False
            if old.addr < region.addr + region.nbytes and region.addr < old.addr + old.nbytes:
                raise CacheUsageError(
                    f"{region.nbytes} bytes at {region.addr:#x} overlap the registered "
                    f"{old.nbytes} bytes at {old.addr:#x}: register each pool tensor once, whole")
        self.regions = sorted([*self.regions, region])
        self._starts = np.array([r.addr for r in self.regions], np.uint64)
        self._ends = np.array([r.addr + r.nbytes for r in self.regions], np.uint64)
        self._devices = sorted({r.device for r in self.regions})
        self._codes = np.array([self._devices.index(r.device) for r in self.regions], np.int64)
        return True

    def locate(self, rows: np.ndarray) -> np.ndarray:
        """Index of the region holding each row whole, -1 where none does (int64, shape (n,))."""
        addr, size = rows[:, 0], rows[:, 1]
        idx = np.searchsorted(self._starts, addr, side="right").astype(np.int64) - 1
        safe = np.maximum(idx, 0)
        inside = (idx >= 0) & (size > 0) & (addr + size >= addr)  # no uint64 wrap-around
        if len(self.regions):
            inside &= addr + size <= self._ends[safe]
        else:
            inside[:] = False
        return np.where(inside, idx, -1)

    def device_of(self, idx: np.ndarray) -> str:
        """The one device all located rows live on; CacheUsageError when they mix devices."""
        if len(self.regions) == 1 or not len(idx):
            return self.regions[0].device
        codes = self._codes[idx]
        if codes.min() != codes.max():
            devices = sorted({self._devices[c] for c in np.unique(codes).tolist()})
            raise CacheUsageError(f"one write moves rows of one device; these rows lie on "
                                  f"{devices}: split the write per device")
        return self._devices[int(codes[0])]

    def first_outside(self, rows: np.ndarray, idx: np.ndarray) -> str | None:
        """A description of the first row that lies outside every region, or None."""
        bad = np.flatnonzero(idx < 0)
        if not len(bad):
            return None
        i = int(bad[0])
        addr, size = (int(v) for v in rows[i])
        return (f"row {i} ({size} bytes at {addr:#x}; {len(bad)} such rows) lies outside the "
                f"{len(self.regions)} registered regions")
