"""A page allocator: a free list over `num_pages` page ids with double-alloc/free detection."""
from __future__ import annotations

from typing import Callable, Iterable, Sequence

from kvtier.errors import AllocatorError


class PageAllocator:
    """Hands out page ids 0..num_pages-1.

    `alloc` returns None when it cannot satisfy the request (the caller evicts and retries);
    `free` of a page that is not allocated raises, because it means two owners held it.
    Pages come out in ascending runs while the pool is unfragmented, which lets copies merge.
    """

    __slots__ = ("num_pages", "_free", "_allocated", "on_free")

    def __init__(self, num_pages: int,
                 on_free: Callable[[list[int]], None] | None = None) -> None:
        """`on_free(pages)` runs after pages return to the free list (a pool's sidecar drops
        what it kept for them)."""
        if not isinstance(num_pages, int) or num_pages < 1:
            raise AllocatorError(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() yields 0, 1, 2, ...
        self._allocated = bytearray(num_pages)
        self.on_free = on_free

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """`n` free page ids, or None when fewer than `n` are free (nothing is taken then)."""
        if n < 0:
            raise AllocatorError(f"cannot allocate {n} pages")
        free = self._free
        if n > len(free):
            return None
        if n == 0:
            return []
        pages = free[-n:]
        del free[-n:]
        pages.reverse()
        allocated = self._allocated
        for p in pages:
            if allocated[p]:
                raise AllocatorError(f"page {p} handed out twice: the free list is corrupt")
            allocated[p] = 1
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the free list; raises on a page that is not allocated."""
        allocated = self._allocated
        pages = list(pages)
        for i, p in enumerate(pages):
            if not 0 <= p < self.num_pages or not allocated[p]:
                for q in pages[:i]:  # undo, so a failed free changes nothing
                    allocated[q] = 1
                state = "out of range" if not 0 <= p < self.num_pages else "not allocated"
                raise AllocatorError(f"free of page {p}: {state} (double free or foreign page)")
            allocated[p] = 0
        pages.reverse()
        self._free.extend(pages)
        if self.on_free is not None and pages:
            self.on_free(pages)

    def is_allocated(self, page: int) -> bool:
        return bool(self._allocated[page])

    def allocated_pages(self) -> list[int]:
        return [p for p, used in enumerate(self._allocated) if used]

    def reset(self) -> None:
        if self.on_free is not None:
            self.on_free(self.allocated_pages())
        self._free = list(range(self.num_pages - 1, -1, -1))
        self._allocated = bytearray(self.num_pages)

    def check(self, owned: Sequence[int] = ()) -> None:
        """Internal consistency: free + allocated partition the pages (tests call this)."""
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "duplicate page on the free list"
        for p in range(self.num_pages):
            assert (p in free_set) != bool(self._allocated[p]), f"page {p} both free and used"
