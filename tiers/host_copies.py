"""L1->L2 copies in flight for one rank's cache.

Each copy locks its run in L1 until it lands, so the source pages cannot change under it. A
copy that fails leaves L2 pages holding no valid data: they are forgotten at once (freed, never
loaded back nor backed up to L3) and the run stays in L1 only. Why a class of its own: the
controller reports landed and failed copies by op id, through `poll_writes` and `wait_writes`
alike; this is the one place that turns those reports into tree changes.
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Sequence

from kvtier.errors import TransferError
from kvtier.tiers.controller import CacheController
from kvtier.tiers.radix_tree import HiRadixTree
from kvtier.tiers.sliding_kv import SlidingKV
from kvtier.tiers.tree_node import TreeNode

log = logging.getLogger(__name__)


class LandedCopy(NamedTuple):
    node: TreeNode  # unlocked now; its L2 copy is valid
    hashes: list[str] | None  # the page hashes to announce (when a listener asked for them)
    host_pages: list[int]  # the L2 pages it filled, one per hash (taken when it started)


class HostCopies:
    """The L1->L2 copies a cache started and has not yet seen land (see the module docstring)."""

    def __init__(self, controller: CacheController, tree: HiRadixTree,
                 count_failed: Callable[[int], None], page_size: int,
                 sliding: SlidingKV | None = None) -> None:
        """`count_failed(tokens)`: the cache's counter of failed copies (it owns its
        counters). `sliding`: a hybrid model's sidecars, whose slots follow every copy (at
        once)."""
        self.controller, self.tree, self.sliding = controller, tree, sliding
        self._count_failed, self.page_size = count_failed, page_size
        self._pending: dict[int, tuple[TreeNode, list[int], list[str] | None]] = {}

    def __bool__(self) -> bool:
        return bool(self._pending)

    def in_flight(self, host_pages: Sequence[int]) -> bool:
        """Is any of these L2 pages the target of a copy that has not landed yet?"""
        if not self._pending:
            return False
        wanted = set(host_pages)
        return any(not wanted.isdisjoint(pages) for _, pages, _ in self._pending.values())

    def start(self, node: TreeNode, host_pages: Sequence[int],
              hashes: list[str] | None = None) -> None:
        """Copy `node`'s L1 pages to `host_pages`; the node is locked until the copy lands."""
        op = self.controller.write(node.value, host_pages)
        if self.sliding is not None:
            self.sliding.copy_to_host(node.value, host_pages)
        self.tree.set_backup(node, host_pages)
        self.tree.lock(node)
        self._pending[op] = (node, list(host_pages), hashes)

    def copy_now(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> bool:
        """Copy and wait (write_back on eviction); False when this copy failed."""
        op = self.controller.write(device_pages, host_pages)
        if self.sliding is not None:
            self.sliding.copy_to_host(device_pages, host_pages)
        return op not in self._wait()

    def landed(self) -> list[LandedCopy]:
        """Copies that landed since the last call (their runs unlocked); failed ones are
        forgotten on the way."""
        while True:
            try:
                ops = self.controller.poll_writes()
                break
            except TransferError as exc:
                self._forget_failed(exc)
        out = []
        for op in ops:
            entry = self._pending.pop(op, None)
            if entry is not None:
                self.tree.unlock(entry[0])
                out.append(LandedCopy(entry[0], entry[2], entry[1]))
        return out

    def wait(self) -> None:
        """Block until every copy landed or failed (`landed` then reports them)."""
        self._wait()

    def _wait(self) -> tuple[int, ...]:
        try:
            self.controller.wait_writes()
            return ()
        except TransferError as exc:
            return self._forget_failed(exc)

    def _forget_failed(self, exc: TransferError) -> tuple[int, ...]:
        failed = tuple(getattr(exc, "op_ids", ()))
        for op in failed:
            entry = self._pending.pop(op, None)
            if entry is None:
                continue
            node, host_pages, _ = entry
            log.warning("an L1->L2 copy of %d pages failed (%s); they stay in L1 only",
                        len(host_pages), exc)
            self.tree.drop_backup(node, host_pages)
            self.tree.unlock(node)
            self._count_failed(len(host_pages) * self.page_size)
        return failed

    def clear_hashes(self) -> None:
        """The listener went away: nothing pending is announced any more."""
        self._pending = {op: (n, pages, None) for op, (n, pages, _) in self._pending.items()}
