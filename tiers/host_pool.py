"""The L2 pool: one rank's KV pages in host memory, in one of four byte orders (MemLayout).

`page_head` is the layout L3 uses: page, then KV head, then layer and token, so each head's
K (or V) bytes of a page are one contiguous run, the object a backend reads or writes in
place (`page_head_view`). The L2<->L1 copy does the transpose (`layer_page_view`)."""
from __future__ import annotations

import logging
import math
import mmap

import numpy as np
import torch

from kvtier.errors import AllocatorError, ClosedError, ConfigError, HostMemoryError, TransferError
from kvtier.kv_spec import KVSpec
from kvtier.policies import MemLayout
from kvtier.tiers.allocator import PageAllocator
from kvtier.tiers.device_pool import DevicePool
from kvtier.tiers.sidecar import Sidecar, sidecar_slots

log = logging.getLogger(__name__)

GiB = 1 << 30
GB = 10**9  # --hicache-size is in GB per rank, as in the reference
DEFAULT_RATIO = 2.0
MIN_FREE_BYTES = 1 * GiB  # keep at least this much, or 10% of what is available, for the rest
MIN_FREE_FRACTION = 0.10


def available_host_bytes() -> int | None:
    """MemAvailable from /proc/meminfo, or None where the kernel does not report it."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_host_memory(nbytes: int) -> None:
    """Raise HostMemoryError when `nbytes` would eat into the margin of free host memory."""
    available = available_host_bytes()
    if available is None:
        log.warning("cannot read MemAvailable; allocating the L2 pool unchecked")
        return
    usable = available - max(MIN_FREE_BYTES, int(available * MIN_FREE_FRACTION))
    if nbytes > usable:
        raise HostMemoryError(
            f"asked {nbytes / GiB:.2f} GiB for the L2 pool but only {max(usable, 0) / GiB:.2f} GiB "
            f"available ({available / GiB:.2f} GiB free minus a safety margin); "
            "lower --hicache-ratio/--hicache-size"
        )


def _shape(spec: KVSpec, num_pages: int, layout: MemLayout) -> tuple[int, ...]:
    L, P, H, D = spec.num_layers, spec.page_size, spec.num_kv_heads, spec.head_dim
    if layout is MemLayout.LAYER_FIRST:
        return (2, L, num_pages * P, H, D)
    if layout is MemLayout.PAGE_FIRST:
        return (2, num_pages * P, L, H, D)
    if layout is MemLayout.PAGE_HEAD:
        return (2, num_pages, H, L, P, D)
    return (2, num_pages, L, P, H, D)


# Fault the whole mapping in when it is made (Linux; 0 elsewhere: pages fault on first write).
MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def _allocate(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """Uninitialized on purpose: pages are only ever written whole before they are read.

    Pinned memory (CUDA) is page-aligned already; torch's CPU allocator aligns to 64 B only, so
    without CUDA the pool is an anonymous mmap: 4 KiB-aligned, so O_DIRECT reads and writes can
    target page parts in place. The tensor keeps the mapping alive; it unmaps with the last view.

    Why populated: pinned memory is resident from the start, and so is this mapping. Left to
    fault in lazily, every L2 page's first copy paid ~4x a warm copy in page faults (35 MB of
    SmolLM2 fp32 pages: ~55 ms vs ~12 ms on 2 cores), on the request path where write_back
    copies an evicted run before handing its L1 pages to a prefill.
    """
    if pinned:
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_POPULATE)
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).view(shape)


class HostPool:
    """`kv` in the layout's shape; pinned when CUDA is present (the CPU build cannot pin)."""

    def __init__(self, spec: KVSpec, num_pages: int, layout: MemLayout = MemLayout.PAGE_FIRST,
                 slots: int | None = None) -> None:
        """A hybrid model's spec (`spec.sliding`) adds a sidecar of `slots` slots, in the same
        layout, for its sliding-window layers (None: `sidecar_slots`)."""
        if not isinstance(num_pages, int) or num_pages < 1:
            raise ConfigError(f"the host pool needs a positive page count, got {num_pages!r}")
        self.spec = spec
        self.num_pages = num_pages
        self.layout = MemLayout.parse(layout, "--hicache-mem-layout")
        check_host_memory(num_pages * spec.page_bytes)
        self.pinned = torch.cuda.is_available()
        self._kv: torch.Tensor | None = _allocate(_shape(spec, num_pages, self.layout), spec.dtype, self.pinned)
        self.sidecar: Sidecar | None = None
        if spec.sidecar is not None:
            slot_pool = HostPool(spec.sidecar, sidecar_slots(spec, num_pages, slots), self.layout)
            self.sidecar = Sidecar(slot_pool, num_pages)
        self.allocator = PageAllocator(num_pages, self.sidecar.drop if self.sidecar else None)
        log.info(
            "L2 pool: %d pages, %.2f GiB, layout %s, pinned=%s",
            num_pages, self.nbytes / GiB, self.layout, self.pinned,
        )

    @classmethod
    def for_device(
        cls,
        device_pool: DevicePool,
        layout: MemLayout = MemLayout.PAGE_FIRST,
        ratio: float = DEFAULT_RATIO,
        size_gb: float | None = None,
    ) -> "HostPool":
        """Size L2 as `ratio` x the L1 pool, or as `size_gb` GB per rank (which wins when set)."""
        spec = device_pool.spec
        if size_gb is not None:
            if size_gb <= 0:
                raise ConfigError(f"--hicache-size must be positive GB per rank, got {size_gb}")
            num_pages = int(size_gb * GB) // spec.page_bytes
            source = f"--hicache-size {size_gb} GB"
        else:
            if ratio <= 0:
                raise ConfigError(f"--hicache-ratio must be positive, got {ratio}")
            num_pages = int(device_pool.num_pages * ratio)
            source = f"--hicache-ratio {ratio}"
        if num_pages < 1:
            raise ConfigError(
                f"{source} gives no whole page of {spec.page_bytes} bytes; raise it"
            )
        if num_pages < device_pool.num_pages:
            log.warning("L2 (%d pages) is smaller than L1 (%d pages): %s", num_pages, device_pool.num_pages, source)
        return cls(spec, num_pages, layout)

    @property
    def kv(self) -> torch.Tensor:
        if self._kv is None:
            raise ClosedError("the host pool is closed; create a new HostPool")
        return self._kv

    @property
    def nbytes(self) -> int:
        """Bytes of the full-attention layers' pages (the sidecar's are `sidecar.slots`)."""
        return self.num_pages * self.spec.page_bytes

    def data_ptr(self) -> int:
        """Start of the pool's memory, for registration with storage engines."""
        return self.kv.data_ptr()

    def layer_page_view(self) -> torch.Tensor:
        """(2, L, num_pages, page_size, H, D) over the same memory: the view page copies index."""
        kv, spec = self.kv, self.spec
        L, P, H, D = spec.num_layers, spec.page_size, spec.num_kv_heads, spec.head_dim
        if self.layout is MemLayout.LAYER_FIRST:
            return kv.view(2, L, self.num_pages, P, H, D)
        if self.layout is MemLayout.PAGE_FIRST:
            return kv.view(2, self.num_pages, P, L, H, D).permute(0, 3, 1, 2, 4, 5)
        if self.layout is MemLayout.PAGE_HEAD:  # (2, pages, H, L, P, D)
            return kv.permute(0, 3, 1, 4, 2, 5)
        return kv.permute(0, 2, 1, 3, 4, 5)

    def page_part_view(self, page: int, part: int) -> torch.Tensor:
        """K (part 0) or V (part 1) of one page over all layers: one contiguous uint8 run.

        This is one storage object; backends read and write it in place (zero copy).
        """
        if not self.layout.is_page_major:
            raise ConfigError(
                "layer_first scatters a page over one run per layer, so it has no single page "
                "object; use --hicache-mem-layout page_first or page_first_direct"
            )
        if part not in (0, 1):
            raise TransferError(f"part must be 0 (K) or 1 (V), got {part!r}")
        if not 0 <= page < self.num_pages:
            raise AllocatorError(f"page {page} is outside the host pool (0..{self.num_pages - 1})")
        kv, P = self.kv, self.spec.page_size
        run = kv[part, page * P : (page + 1) * P] if self.layout is MemLayout.PAGE_FIRST else kv[part, page]
        assert run.is_contiguous()
        return run.view(-1).view(torch.uint8)

    def relayout(self, layout: MemLayout) -> None:
        """Hold every page in `layout` from now on: same page ids, same bytes, a new tensor
        (the old one is dropped). For a cache that attaches L3 at run time: L3 needs
        page_head. The caller makes sure no copy is in flight; it costs one more pool of host
        memory for the moment."""
        layout = MemLayout.parse(layout, "--hicache-mem-layout")
        if layout is self.layout:
            return
        check_host_memory(self.nbytes)
        old = self.layer_page_view()
        self._kv = _allocate(_shape(self.spec, self.num_pages, layout), self.spec.dtype,
                             self.pinned)
        before, self.layout = self.layout, layout
        self.layer_page_view().copy_(old)
        if self.sidecar is not None:  # its slots keep their ids and bytes too
            self.sidecar.slots.relayout(layout)
        log.info("L2 pool: %s -> %s (%d pages)", before, layout, self.num_pages)

    def page_head_view(self, page: int, head: int, part: int) -> torch.Tensor:
        """K (part 0) or V (part 1) of KV head `head` (this pool's own index) of one page, over
        all layers and tokens: one contiguous uint8 run, one L3 object (page_head only)."""
        if not self.layout.is_head_major:
            raise ConfigError(
                f"the {self.layout} layout interleaves a page's KV heads, so one head has no "
                "single run of bytes; use --hicache-mem-layout page_head")
        if part not in (0, 1):
            raise TransferError(f"part must be 0 (K) or 1 (V), got {part!r}")
        if not 0 <= page < self.num_pages:
            raise AllocatorError(f"page {page} is outside the host pool (0..{self.num_pages - 1})")
        if not 0 <= head < self.spec.num_kv_heads:
            raise TransferError(f"head {head} is outside this pool's KV heads "
                                f"(0..{self.spec.num_kv_heads - 1})")
        run = self.kv[part, page, head]
        assert run.is_contiguous()
        return run.view(-1).view(torch.uint8)

    def head_objects(self) -> np.ndarray:
        """(2, num_pages, H, object bytes) uint8 over the pool's memory: [part, page, head] is
        `page_head_view(page, head, part)`'s run, without its per-call checks (page_head
        only): what sums many head objects at once indexes."""
        if not self.layout.is_head_major:
            raise ConfigError(
                f"the {self.layout} layout interleaves a page's KV heads, so one head has no "
                "single run of bytes; use --hicache-mem-layout page_head")
        kv = self.kv
        return kv.view(-1).view(torch.uint8).numpy().reshape(
            2, self.num_pages, self.spec.num_kv_heads, -1)

    def close(self) -> None:
        self._kv = None
        if self.sidecar is not None:
            self.sidecar.slots.close()

    def __enter__(self) -> "HostPool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
