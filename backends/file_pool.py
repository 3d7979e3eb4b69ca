"""One registered pool as the file backend sees it: object names, paths and page memory.

Why precompute: `StorageTarget.object_name` re-derives the namespace digest (~20 us) and
`HostPool.page_head_view` indexes a tensor (~30 us) on every call; at ~300 us per object
write that alone would cost a sixth of the bandwidth. A page is one object per owned KV head
and part (the registration's `slots`); names are the same strings (prefix + key + suffix,
derived from `object_name` itself), and page memory is one strided numpy view over the pool
per slot, checked against `page_head_view` at registration.
"""
from __future__ import annotations

import os

import numpy as np

from kvtier.backends.base import PoolRegistration, StorageTarget
from kvtier.errors import CacheUsageError, ConfigError

_SAMPLE_KEY = "0" * 64


class PoolFiles:
    """Names, paths and zero-copy page views of one pool registered with a file backend."""

    def __init__(self, root: str, target: StorageTarget, reg: PoolRegistration) -> None:
        if reg.num_parts not in (1, 2):
            raise CacheUsageError(f"pool {reg.name!r}: num_parts must be 1 (K) or 2 (K and V), "
                                  f"got {reg.num_parts}")
        sample = [target.object_name(reg.name, _SAMPLE_KEY, s.head, s.part) for s in reg.slots]
        self.rel_dir = sample[0].rsplit("/", 1)[0]
        self.dir = os.path.join(root, self.rel_dir)
        self.suffixes = tuple(name.rsplit("/", 1)[1][len(_SAMPLE_KEY):] for name in sample)
        self.reg = reg
        self.rows = [_page_rows(reg, i) for i in range(len(reg.slots))]
        self.part_bytes = self.view(0, 0).nbytes

    def names(self, key: str) -> list[str]:
        """Same strings as `StorageTarget.object_name(pool, key, head, part)` per slot."""
        return [f"{self.rel_dir}/{key}{suffix}" for suffix in self.suffixes]

    def paths(self, key: str) -> list[str]:
        return [f"{self.dir}/{key}{suffix}" for suffix in self.suffixes]

    def view(self, page: int, slot: int) -> memoryview:
        """Object `slot` (a head's part) of host page `page`, in place (no copy)."""
        rows = self.rows[slot]
        if rows is None or not 0 <= page < len(rows):  # the pool's own checks and errors
            return memoryview(self.reg.view(page, slot).numpy())
        return memoryview(rows[page])

    def close(self) -> None:
        """Drop the views, so the pool's memory can be unmapped once its owner closes it."""
        self.rows = [None] * len(self.rows)


def _page_rows(reg: PoolRegistration, slot: int) -> np.ndarray | None:
    """(num_pages, object_bytes) strided view over every page's object `slot`, or None when
    the pool does not place pages at a fixed stride (then each access asks `reg.view`)."""
    pool = reg.pool
    try:
        first = reg.view(0, slot)
    except ConfigError as exc:  # a layout whose heads are not one run of bytes
        raise CacheUsageError(str(exc)) from exc
    if first.element_size() != 1 or first.dim() != 1 or not first.is_contiguous():
        raise CacheUsageError(f"pool {reg.name!r}: page_head_view must return a contiguous "
                              "1-D uint8 tensor (see kvtier.tiers.host_pool.HostPool)")
    arr, n = first.numpy(), pool.num_pages
    if n == 1:
        return arr[None, :]
    stride = reg.view(1, slot).data_ptr() - first.data_ptr()
    if stride < arr.nbytes:  # overlapping or descending pages: not a plain stride
        return None
    start, end = first.data_ptr(), first.data_ptr() + (n - 1) * stride + arr.nbytes
    if not pool.data_ptr() <= start < end <= pool.data_ptr() + pool.nbytes:
        return None  # the rows would reach outside the pool's one registered region
    rows = np.lib.stride_tricks.as_strided(arr, shape=(n, arr.nbytes), strides=(stride, 1))
    for page in sorted({1, n // 2, n - 1}):  # the stride holds to the last page
        if rows[page].ctypes.data != reg.view(page, slot).data_ptr():
            return None
    return rows
