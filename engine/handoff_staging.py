"""A hand-off between instances of different TP sizes, staged through L2 in `page_head`.

A prefill rank and a decode rank of different TP sizes hold different KV heads, and an L1
page interleaves its heads token by token: one head's share of an L1 page is page_size
short runs. L2 in `page_head` keeps each head's K (or V) of a page, over every layer, as one
contiguous object (the one L3 stores). So: the prefill rank copies the request's L1 pages
into L2 staging pages, writes each head object the decode rank holds into the decode rank's
L2 staging pages (whole pages per head: no descriptor is smaller than one head's page part),
and the decode rank checks each object's sum and copies its staging pages into the L1
pages it reserved."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import xxhash

from kvtier.kv_spec import KVSpec
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.device_pool import DevicePool


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


def head_sums(host: HostPool, pages: Sequence[int], heads: Sequence[int]) -> tuple[int, ...]:
    """xxh3_64 over each (page, head)'s K then V object, page by page then head."""
    out = []
    for page in pages:
        for head in heads:
            h = xxhash.xxh3_64()
            h.update(host.page_head_view(page, head, 0).numpy())
            h.update(host.page_head_view(page, head, 1).numpy())
            out.append(h.intdigest())
    return tuple(out)


def copy_to_host(device: DevicePool, host: HostPool, device_pages: Sequence[int],
                 host_pages: Sequence[int]) -> None:
    """L1 pages into L2 pages, synchronously (any host layout)."""
    dv, hv = device.layer_page_view(), host.layer_page_view()
    for d, h in zip(device_pages, host_pages):
        hv[:, :, h].copy_(dv[:, :, d])


def copy_to_device(host: HostPool, device: DevicePool, host_pages: Sequence[int],
                   device_pages: Sequence[int]) -> None:
    dv, hv = device.layer_page_view(), host.layer_page_view()
    for h, d in zip(host_pages, device_pages):
        dv[:, :, d].copy_(hv[:, :, h])
    if dv.is_cuda:
        import torch

        torch.cuda.current_stream(dv.device).synchronize()
