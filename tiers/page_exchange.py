"""One rank's pools as a transport between ranks sees them: where their bytes are, the rows
(addr, nbytes) of given pages, the pages' sums, and the L1<->L2 staging copies.

The prefill/decode hand-off (kvtier.engine.handoff) writes a request's L1 pages straight
into another rank's L1 pages when both ranks hold the same KV heads. Ranks of different TP
sizes hold different heads, and an L1 page interleaves its heads token by token (one head's
share of it is page_size short runs), so such a hand-off is staged: L2 in `page_head` keeps
each head's K (or V) of a page, over every layer, as one contiguous object (the one L3
stores). The prefill rank copies the request's L1 pages into L2 staging pages, writes each
head object the decode rank holds into the decode rank's L2 staging pages (whole pages per
head: no descriptor is smaller than one head's page part), and the decode rank checks each
object's sum and copies its staging pages into the L1 pages it reserved.

Everything the hand-off does with this rank's memory goes through `PageExchange`, which the
cache owns (`HierarchicalCache.exchange`): the hand-off code never holds a pool. The module
functions address a peer's pool from what its `HandoffTarget` says (base address, pages).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np
import torch
import xxhash

from kvtier.errors import CacheUsageError, ConfigError
from kvtier.kv_spec import KVSpec
from kvtier.tiers.device_pool import DevicePool
from kvtier.tiers.host_pool import HostPool


class PoolMemory(NamedTuple):
    """One pool's buffer, as a transport registers it and a peer addresses it."""

    addr: int       # its first byte
    nbytes: int     # its full-attention pages' bytes
    num_pages: int  # its page count (with the layout, where each page lies)
    device: str     # "cpu", "cuda:0", ...


def pool_regions(spec: KVSpec, base_addr: int, pool_pages: int,
                 pages: Sequence[int]) -> np.ndarray:
    """(2 * layers * len(pages), 2) uint64 rows (addr, nbytes) of `pages` in an L1 pool of
    shape (2, layers, pool_pages, page_size, heads, head_dim) starting at `base_addr`; page
    by page, and within a page part then layer. A run is one layer's K or V of one page."""
    n = spec.page_layer_bytes
    ids = np.asarray(pages, dtype=np.uint64)
    if ids.size and int(ids.max()) >= pool_pages:
        raise ConfigError(f"page {int(ids.max())} is outside a pool of {pool_pages} pages")
    runs = np.arange(2 * spec.num_layers, dtype=np.uint64)  # part * layers + layer
    offsets = (runs[None, :] * np.uint64(pool_pages) + ids[:, None]) * np.uint64(n)
    rows = np.empty((offsets.size, 2), dtype=np.uint64)
    rows[:, 0] = offsets.reshape(-1) + np.uint64(base_addr)
    rows[:, 1] = n
    return rows


def head_object_bytes(spec: KVSpec) -> int:
    """One KV head's K (or V) of one page over every layer (spec: one rank's)."""
    return spec.num_layers * spec.page_size * spec.head_dim * spec.itemsize


def head_regions(spec: KVSpec, pool_heads: int, base_addr: int, pool_pages: int,
                 pages: Sequence[int], heads: Sequence[int]) -> np.ndarray:
    """(len(pages) * len(heads) * 2, 2) rows (addr, nbytes) of head objects in a `page_head`
    host pool of shape (2, pool_pages, pool_heads, L, P, D) at `base_addr`: page by page,
    then head (the pool's own index), then part."""
    n = head_object_bytes(spec)
    p = np.asarray(pages, dtype=np.uint64)[:, None, None]
    h = np.asarray(heads, dtype=np.uint64)[None, :, None]
    part = np.arange(2, dtype=np.uint64)[None, None, :]
    index = (part * np.uint64(pool_pages) + p) * np.uint64(pool_heads) + h
    rows = np.empty((index.size, 2), dtype=np.uint64)
    rows[:, 0] = index.reshape(-1) * np.uint64(n) + np.uint64(base_addr)
    rows[:, 1] = n
    return rows


def object_sums(parts: Sequence[np.ndarray], pages: Sequence[int],
                heads: Sequence[int]) -> tuple[int, ...]:
    """xxh3_64 of each (page, head)'s runs in `parts`, one after the other, page by page then
    head: each part a (pages, heads, bytes) uint8 array over one pool (`page_head`: K, then V;
    the vLLM host pool: K and V together). A page or head outside the arrays is the caller's
    bug (CacheUsageError), never a negative index read from the other end."""
    pages, heads = [int(p) for p in pages], [int(h) for h in heads]
    for what, ids, limit in (("page", pages, parts[0].shape[0]),
                             ("head", heads, parts[0].shape[1])):
        bad = [i for i in ids if not 0 <= i < limit]
        if bad:
            raise CacheUsageError(f"{what} {bad[0]} is outside the host pool (0..{limit - 1})")
    out = []
    for page in pages:
        for head in heads:
            h = xxhash.xxh3_64()
            for part in parts:
                h.update(part[page, head])
            out.append(h.intdigest())
    return tuple(out)


def page_sums(kv: torch.Tensor, pages: Sequence[int]) -> tuple[int, ...]:
    """xxh3_64 of each page's bytes in an L1 pool tensor (2, layers, pages, ...): the same
    value on both sides of a hand-off when the page arrived whole."""
    sums = []
    for page in pages:
        data = kv[:, :, page].contiguous()
        if data.device.type != "cpu":
            data = data.cpu()
        sums.append(xxhash.xxh3_64_intdigest(data.view(torch.uint8).numpy()))
    return tuple(sums)


class PageExchange:
    """This rank's L1 and L2 pools, for a transport: memory to register, rows of pages to
    write or be written, sums to verify with, staging copies. Reads change nothing; the two
    copies change only the pages the caller holds."""

    def __init__(self, device: DevicePool, host: HostPool) -> None:
        self._device, self._host = device, host

    @property
    def l1(self) -> PoolMemory:
        kv = self._device.kv
        return PoolMemory(kv.data_ptr(), kv.numel() * kv.element_size(), self._device.num_pages,
                          str(kv.device))

    @property
    def l2(self) -> PoolMemory:
        """L2's buffer now: a relayout (`HierarchicalCache.use_head_major_host`) moves it."""
        kv = self._host.kv
        return PoolMemory(kv.data_ptr(), kv.numel() * kv.element_size(), self._host.num_pages,
                          "cpu")

    def settle_l1(self) -> None:
        """Wait until the computation's writes to L1 have landed (before a NIC reads it)."""
        kv = self._device.kv
        if kv.is_cuda:
            torch.cuda.current_stream(kv.device).synchronize()

    def l1_regions(self, pages: Sequence[int]) -> np.ndarray:
        """Rows of these L1 pages (`pool_regions`)."""
        return pool_regions(self._device.spec, self._device.kv.data_ptr(),
                            self._device.num_pages, pages)

    def l2_head_regions(self, pool_heads: int, pages: Sequence[int],
                        heads: Sequence[int]) -> np.ndarray:
        """Rows of head objects of these L2 pages (`head_regions`; L2 in `page_head`)."""
        return head_regions(self._host.spec, pool_heads, self._host.kv.data_ptr(),
                            self._host.num_pages, pages, heads)

    def l1_sums(self, pages: Sequence[int]) -> tuple[int, ...]:
        """xxh3_64 of each L1 page (`page_sums`)."""
        return page_sums(self._device.kv, pages)

    def l2_head_sums(self, pages: Sequence[int], heads: Sequence[int]) -> tuple[int, ...]:
        """xxh3_64 over each (page, head)'s K then V object in L2 (`page_head`), page by
        page then head."""
        objects = self._host.head_objects()
        return object_sums((objects[0], objects[1]), pages, heads)

    def copy_to_l2(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> None:
        """L1 pages into L2 pages the caller holds, synchronously (any L2 layout)."""
        dv, hv = self._device.layer_page_view(), self._host.layer_page_view()
        for d, h in zip(device_pages, host_pages):
            hv[:, :, h].copy_(dv[:, :, d])

    def copy_to_l1(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> None:
        """L2 pages into L1 pages the caller holds; landed when this returns."""
        dv, hv = self._device.layer_page_view(), self._host.layer_page_view()
        for h, d in zip(host_pages, device_pages):
            dv[:, :, d].copy_(hv[:, :, h])
        if dv.is_cuda:
            torch.cuda.current_stream(dv.device).synchronize()
