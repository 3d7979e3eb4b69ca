"""Page copies between pools: a plan of runs built once, executed per layer group.

Every pool exposes `layer_page_view()`: a (2, L, num_pages, page_size, H, D) view of its tensor
whatever its layout, so one copy routine serves all layout pairs; only the strides differ.

Why runs: a Python-issued copy costs ~6-8 us however small, so copying page by page and layer by
layer drowns in overhead. Pairs are sorted by destination page (the side a fresh allocation makes
consecutive: L1 pages for loads, L2 pages for writes) and merged into runs:
- DIRECT: maximal runs where source and destination both step by one; one strided `copy_` per
  run moves every layer of the group at once.
- KERNEL: maximal runs of consecutive destination pages; a run whose sources are scattered is
  filled by one `torch.index_select(..., out=run)` (a gather straight into place, no temporary).
Both are correct for every layout; they differ only in how many calls fragmented ids need.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from kvtier.errors import TransferError
from kvtier.policies import IoBackend

PAGE_DIM = 2  # page axis of a layer_page_view: (part, layer, page, token, head, dim)
MIN_CALL_BYTES = 4 << 20  # on the worker thread 1 MiB calls lost ~30% of bandwidth, 4 MiB ~10%


class PageRun(NamedTuple):
    """`n` pages where both the source and the destination ids step by one."""

    src: int
    dst: int
    n: int


class Gather(NamedTuple):
    """`n` consecutive destination pages; `src` holds their source ids (None: a PageRun)."""

    dst: int
    n: int
    src_start: int
    src: torch.Tensor | None


@dataclass(frozen=True)
class CopyPlan:
    """Validated (src, dst) page pairs sorted by destination, merged into runs."""

    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    runs: tuple[PageRun, ...]
    gathers: tuple[Gather, ...]

    @property
    def num_pages(self) -> int:
        return len(self.dst_pages)

    @classmethod
    def build(
        cls,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        src_capacity: int,
        dst_capacity: int,
    ) -> "CopyPlan":
        """Check the page lists (raises TransferError) and merge them into runs."""
        src_list, dst_list = [int(p) for p in src_pages], [int(p) for p in dst_pages]
        if len(src_list) != len(dst_list):
            raise TransferError(
                f"page lists differ in length: {len(src_list)} source vs {len(dst_list)} "
                "destination pages; pass one destination page per source page"
            )
        _check_range("source", src_list, src_capacity)
        _check_range("destination", dst_list, dst_capacity)
        if len(set(dst_list)) != len(dst_list):
            raise TransferError("a destination page appears twice; each page can hold one copy")
        pairs = sorted(zip(dst_list, src_list))
        dst_sorted = tuple(d for d, _ in pairs)
        src_sorted = tuple(s for _, s in pairs)
        return cls(src_sorted, dst_sorted, _runs(src_sorted, dst_sorted), _gathers(src_sorted, dst_sorted))

    def calls(self, backend: IoBackend) -> int:
        """Copy calls one layer group costs with `backend`."""
        return len(self.gathers) if backend is IoBackend.KERNEL else len(self.runs)

    def layers_per_call(self, backend: IoBackend, page_layer_bytes: int, num_layers: int) -> int:
        """How many layers to copy per call so each call moves at least MIN_CALL_BYTES.

        Loads go layer by layer so attention on layer l can start while l+1 lands, but with
        fragmented ids a single layer is many tiny copies; grouping layers keeps bandwidth.
        """
        calls = self.calls(backend)
        if calls == 0:
            return num_layers
        bytes_per_layer_call = 2 * page_layer_bytes * self.num_pages / calls
        return max(1, min(num_layers, math.ceil(MIN_CALL_BYTES / bytes_per_layer_call)))


def _check_range(side: str, pages: list[int], capacity: int) -> None:
    bad = [p for p in pages if not 0 <= p < capacity]
    if bad:
        raise TransferError(f"{side} page {bad[0]} is outside the pool (0..{capacity - 1})")


def _runs(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[PageRun, ...]:
    runs: list[PageRun] = []
    i = 0
    while i < len(dst):
        n = 1
        while i + n < len(dst) and dst[i + n] == dst[i] + n and src[i + n] == src[i] + n:
            n += 1
        runs.append(PageRun(src[i], dst[i], n))
        i += n
    return tuple(runs)


def _gathers(src: tuple[int, ...], dst: tuple[int, ...]) -> tuple[Gather, ...]:
    gathers: list[Gather] = []
    i = 0
    while i < len(dst):
        n = 1
        while i + n < len(dst) and dst[i + n] == dst[i] + n:
            n += 1
        chunk = src[i : i + n]
        consecutive = all(chunk[k] == chunk[0] + k for k in range(n))
        index = None if consecutive else torch.tensor(chunk, dtype=torch.int64)
        gathers.append(Gather(dst[i], n, chunk[0], index))
        i += n
    return tuple(gathers)


def copy_pages(
    src: torch.Tensor,
    dst: torch.Tensor,
    plan: CopyPlan,
    backend: IoBackend,
    layers: slice = slice(None),
    non_blocking: bool = False,
) -> None:
    """Copy the plan's pages for `layers` from `src` to `dst` (both layer_page_views)."""
    src, dst = src[:, layers], dst[:, layers]
    if src.device != dst.device:
        # Host<->device: index ops cannot span devices, so both backends copy runs.
        for run in plan.runs:
            _copy_across(_slice(dst, run.dst, run.n), _slice(src, run.src, run.n), non_blocking)
    elif backend is IoBackend.KERNEL:
        for g in plan.gathers:
            out = _slice(dst, g.dst, g.n)
            if g.src is None:
                out.copy_(_slice(src, g.src_start, g.n))
            else:
                index = g.src if g.src.device == src.device else g.src.to(src.device)
                torch.index_select(src, PAGE_DIM, index, out=out)
    else:
        for run in plan.runs:
            _slice(dst, run.dst, run.n).copy_(_slice(src, run.src, run.n))


def _slice(view: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return view[:, :, start : start + n]


def _copy_across(dst: torch.Tensor, src: torch.Tensor, non_blocking: bool) -> None:
    """One part at a time, both sides permuted into the host side's memory order.

    torch moves a host<->device copy through a contiguous staging tensor unless the host side is
    already contiguous; in that order a page run of a page layout is one DMA and the device
    side does the transposition.
    """
    host = src if src.device.type == "cpu" else dst
    for part in range(src.shape[0]):
        h = host[part]
        order = sorted(range(h.dim()), key=lambda d: (-h.stride(d), d))
        dst[part].permute(order).copy_(src[part].permute(order), non_blocking=non_blocking)
