"""HiRadixTree: page-aligned token prefixes and the tier (L1/L2) of every page.

Runs without Ray and without a GPU: it only does bookkeeping of page ids. The pools hold the
bytes; the cache facade moves them. The tree is the one writer of its nodes: the cache and the
L3 tier change a node (locks, L2 copies, L3 state) only through its methods. Sizes and
candidate queues live in its ledger (tree_ledger), kept current on every change, and the
eviction policy (tree_eviction) picks victims from them, so no operation walks the whole tree.
"""
from __future__ import annotations

import itertools
from typing import Callable, Sequence

from kvtier.errors import CacheUsageError
from kvtier.policies import CacheEventKind, CacheTier
from kvtier.tiers import tree_eviction
from kvtier.tiers.allocator import PageAllocator
from kvtier.tiers.tree_ledger import TreeLedger
from kvtier.tiers.tree_l3 import TreeL3Marks
from kvtier.tiers.tree_node import STORED, TreeNode, as_key
from kvtier.tiers.tree_types import EvictResult, InsertResult, MatchResult, TreeStats

# Called for an L1 page run that is about to be evicted and has no L2 copy (write_back
# policy): returns the L2 page ids now holding a copy, or None to drop the run instead.
WriteBackFn = Callable[[TreeNode], "list[int] | None"]
# Told when a node's pages enter or leave a tier (`HierarchicalCache.set_event_listener`
# turns nodes into page hashes); called while the node still has its key and parent.
TreeListener = Callable[[CacheEventKind, CacheTier, TreeNode], None]


class HiRadixTree:
    """A radix tree over whole pages of tokens; nodes know their L1 and L2 page ids."""

    def __init__(
        self,
        page_size: int,
        device_allocator: PageAllocator,
        host_allocator: PageAllocator | None = None,
        write_back: WriteBackFn | None = None,
    ) -> None:
        if page_size < 1:
            raise CacheUsageError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.device_allocator = device_allocator
        self.host_allocator = host_allocator
        self.write_back = write_back
        self.listener: TreeListener | None = None  # None: no events, no cost
        self._ids = itertools.count(1)
        self._clock = 0
        self.root = self._new_root("")
        # one root per cache salt: a salted request's prefixes live under its own root, so no
        # other salt matches them. Salted roots come with their first node and go with their
        # last one, so unknown salts (a client's choice) leave nothing behind.
        self._roots: dict[str, TreeNode] = {"": self.root}
        self.ledger = TreeLedger()
        self.l3 = TreeL3Marks(self)  # the L3 state of each run (the L3 tier writes it here)
        self._account, self._refresh = self.ledger.account, self.ledger.refresh

    @staticmethod
    def _new_root(salt: str) -> TreeNode:
        root = TreeNode(0, (), None, salt)
        root.value, root.host_value, root.lock_ref = [], [], 1  # never evicted
        return root

    def root_of(self, salt: str) -> TreeNode:
        """The root of `salt`'s prefixes; an empty stand-in (not kept) for a salt with none."""
        if not isinstance(salt, str):
            raise CacheUsageError(f"a cache salt is a string, got {type(salt).__name__}")
        root = self._roots.get(salt)
        return root if root is not None else self._new_root(salt)

    def _kept_root(self, salt: str) -> TreeNode:
        root = self.root_of(salt)
        self._roots.setdefault(salt, root)
        return root

    def _drop_root_if_empty(self, node: TreeNode) -> None:
        if node.parent is None and node.salt and not node.children:
            self._roots.pop(node.salt, None)

    @property
    def num_salts(self) -> int:
        """Cache salts with stored prefixes (the unsalted root not counted)."""
        return len(self._roots) - 1

    # ---- sizes -------------------------------------------------------------------------
    def stats(self) -> TreeStats:
        return self.ledger.stats()

    def _emit(self, kind: CacheEventKind, tier: CacheTier, node: TreeNode) -> None:
        if self.listener is not None:
            self.listener(kind, tier, node)

    # ---- lookup ------------------------------------------------------------------------
    def match_prefix(self, tokens: Sequence[int], touch: bool = True,
                     salt: str = "") -> MatchResult:
        """The longest stored page-aligned prefix of `tokens` under `salt`, split at its end.

        `touch=False` looks without counting a hit or refreshing LRU order (a probe).
        """
        key = as_key(tokens)
        p = self.page_size
        end = len(key) // p * p
        self._clock += 1
        clock = self._clock
        node = last_device = last_host = self.root_of(salt)
        device: list[int] = []
        host_hit = 0
        pos = 0
        while pos < end:
            child = node.children.get(key[pos : pos + p])
            if child is None:
                break
            span = len(child.key)
            if pos + span > end or key[pos : pos + span] != child.key:
                child = self._split(child, self._common_pages(child.key, key, pos, end))
                span = len(child.key)
            if touch:
                child.last_access = clock
                child.hit_count += 1
            if child.value is not None:
                device.extend(child.value)
                last_device = child
            else:
                host_hit += span
            if child.host_value is not None:
                last_host = child
            pos += span
            node = child
        return MatchResult(device, last_device, last_host, host_hit, p)

    def _common_pages(self, node_key: tuple, key: tuple, pos: int, end: int) -> int:
        """Whole pages that `node_key` shares with `key[pos:end]` (at least the first)."""
        p = self.page_size
        limit = min(len(node_key), end - pos)
        n = p
        while n < limit and node_key[n : n + p] == key[pos + n : pos + n + p]:
            n += p
        return n // p

    def _split(self, child: TreeNode, pages: int) -> TreeNode:
        """Cut `child` after `pages` pages; returns the new upper node."""
        cut = pages * self.page_size
        upper = TreeNode(next(self._ids), child.key[:cut], child.parent)
        child.parent.children[child.key[: self.page_size]] = upper
        child.key = child.key[cut:]
        if child.value is not None:
            upper.value, child.value = child.value[:pages], child.value[pages:]
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:pages], child.host_value[pages:]
        upper.lock_ref, upper.host_ref = child.lock_ref, child.host_ref  # path counts
        upper.pin_ref = child.pin_ref
        upper.hit_count, upper.last_access = child.hit_count, child.last_access
        upper.storage_op = child.storage_op
        upper.children[child.key[: self.page_size]] = child
        upper.device_children = 1 if child.value is not None else 0
        child.parent = upper
        self.ledger.num_nodes += 1
        return upper

    # ---- insertion -----------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], device_pages: Sequence[int],
               salt: str = "") -> InsertResult:
        """Store L1 pages for the page-aligned part of `tokens` (under `salt`).

        `device_pages` has one id per page of `tokens`, a trailing partial page included. Pages
        the tree already holds in L1 stay; the caller's copies come back in `unused_pages`.
        A run that was evicted to L2 takes the caller's freshly computed pages back into L1.
        """
        key, full, unused = self._check_pages(tokens, device_pages)
        p = self.page_size
        self._clock += 1
        node, i, prefix = self.root_of(salt), 0, 0
        for parent, child, i in self._stored_path(key, full, node):
            pages = len(child.key) // p
            seg = device_pages[i : i + pages]
            if child.value is None:
                self._account(child, -1)
                child.value = list(seg)
                self._account(child, +1)
                self._emit(CacheEventKind.STORED, CacheTier.DEVICE, child)
                parent.device_children += 1
                self._refresh(parent)
                self._refresh(child)
            else:
                unused.extend(a for a, b in zip(seg, child.value) if a != b)
                prefix += pages
            node, i = child, i + pages
        if i < full:
            if node.parent is None:
                node = self._kept_root(salt)
            node = self._add_child(node, key[i * p : full * p], device_pages[i:full], None)
        return InsertResult(unused, prefix, full - i, node)

    def insert_host(self, tokens: Sequence[int], host_pages: Sequence[int],
                    skip_pages: int = 0, salt: str = "") -> InsertResult:
        """Store L2-only pages (arriving from L3) for the page-aligned part of `tokens`
        (under `salt`).

        `host_pages` covers pages `skip_pages`.. of `tokens`; the first `skip_pages` pages
        must already be stored (any tier), else nothing can be placed. A new L2-only run hangs
        only below the root or a node that is itself in L2, so every L2-only prefix is complete
        in L2. Pages that cannot be placed, or duplicate stored ones, come back unused.
        """
        key = as_key(tokens)
        full, rest = divmod(len(key), self.page_size)
        if len(host_pages) != full + (1 if rest else 0) - skip_pages or skip_pages > full:
            raise CacheUsageError(
                f"{len(key)} tokens from page {skip_pages} need "
                f"{full + (1 if rest else 0) - skip_pages} page ids, got {len(host_pages)}")
        unused = list(host_pages[full - skip_pages:])
        p = self.page_size
        self._clock += 1
        node, i, prefix = self.root_of(salt), 0, 0
        for _, child, i in self._stored_path(key, full, node, skip_pages):
            pages = len(child.key) // p
            if i >= skip_pages:
                seg = host_pages[i - skip_pages : i - skip_pages + pages]
                if child.host_value is None:
                    self._account(child, -1)
                    child.host_value = list(seg)
                    self._account(child, +1)
                    self._emit(CacheEventKind.STORED, CacheTier.HOST, child)
                else:
                    unused.extend(a for a, b in zip(seg, child.host_value) if a != b)
            prefix += pages
            node, i = child, i + pages
        placed = 0
        if i < skip_pages:  # the prefix the pages continue is gone
            unused.extend(host_pages[: full - skip_pages])
        elif i < full:
            own = host_pages[i - skip_pages : full - skip_pages]
            if node.parent is None or node.host_value is not None:
                if node.parent is None:
                    node = self._kept_root(salt)
                node = self._add_child(node, key[i * p : full * p], None, own)
                placed = full - i
            else:
                unused.extend(own)
        return InsertResult(unused, min(prefix, full), placed, node)

    def _check_pages(self, tokens: Sequence[int], pages: Sequence[int]) -> tuple:
        key = as_key(tokens)
        full, rest = divmod(len(key), self.page_size)
        if len(pages) != full + (1 if rest else 0):
            raise CacheUsageError(
                f"{len(key)} tokens need {full + (1 if rest else 0)} page ids "
                f"(page size {self.page_size}), got {len(pages)}"
            )
        return key, full, list(pages[full:])

    def _stored_path(self, key: tuple, full: int, root: TreeNode, skip: int = 0):
        """Stored nodes along `key[:full pages]` below `root`, root side first, as (parent,
        node, first page); a node is split where the key, or the `skip` boundary, ends inside
        it."""
        p = self.page_size
        node, i = root, 0
        while i < full:
            child = node.children.get(key[i * p : (i + 1) * p])
            if child is None:
                return
            pos, end, span = i * p, full * p, len(child.key)
            if pos + span > end or key[pos : pos + span] != child.key:
                child = self._split(child, self._common_pages(child.key, key, pos, end))
            if i < skip < i + len(child.key) // p:
                child = self._split(child, skip - i)  # the caller's own pages start at skip
            child.last_access = self._clock
            yield node, child, i
            i += len(child.key) // p
            node = child

    def _add_child(self, parent: TreeNode, key: tuple, value, host_value) -> TreeNode:
        node = TreeNode(next(self._ids), key, parent)
        node.value = list(value) if value is not None else None
        node.host_value = list(host_value) if host_value is not None else None
        node.last_access = self._clock
        parent.children[key[: self.page_size]] = node
        if value is not None:
            parent.device_children += 1
        self.ledger.num_nodes += 1
        self._account(node, +1)
        self._refresh(parent)
        self._refresh(node)
        if value is not None:
            self._emit(CacheEventKind.STORED, CacheTier.DEVICE, node)
        if host_value is not None:
            self._emit(CacheEventKind.STORED, CacheTier.HOST, node)
        return node

    def set_backup(self, node: TreeNode, host_pages: Sequence[int]) -> None:
        """Record that `node`'s L1 pages now have L2 copies at `host_pages`."""
        if node.value is None or node.host_value is not None or len(host_pages) != len(node.value):
            raise CacheUsageError(f"set_backup needs an L1-only node and {node.num_pages} pages: {node}")
        node.host_value = list(host_pages)

    def drop_backup(self, node: TreeNode, host_pages: Sequence[int]) -> None:
        """The L1->L2 copy of `node` into `host_pages` failed: forget those L2 pages (on `node`
        and on runs split off above it since) and free them. The L1 pages stay."""
        doomed = set(host_pages)
        for n in node.path_to_root():
            if n.host_value is not None and doomed.issuperset(n.host_value):
                n.host_value = None  # in L1 (locked): no size or queue changes
        self.host_allocator.free(host_pages)

    def release_backup(self, node: TreeNode) -> bool:
        """Give back the L2 copy of a run that is in L1 and stored in L3, unless something
        holds it (a load, a backup); True when it was released."""
        if node.value is None or node.host_value is None or node.host_ref or node.pin_ref \
                or node.storage_op != STORED:
            return False
        self._emit(CacheEventKind.EVICTED, CacheTier.HOST, node)
        self.host_allocator.free(node.host_value)
        node.host_value = None  # in L1: no size or queue changes
        return True

    # ---- protection ----------------------------------------------------------------------
    def lock(self, node: TreeNode) -> None:
        """Protect the L1 pages from `node` to the root against eviction."""
        self.ledger.change_ref(node, "lock_ref", 1)

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`."""
        self.ledger.change_ref(node, "lock_ref", -1)

    def protect_host(self, node: TreeNode) -> None:
        """Protect the L2 pages from `node` to the root (loads, backups in flight)."""
        self.ledger.change_ref(node, "host_ref", 1)

    def release_host(self, node: TreeNode) -> None:
        """Undo one `protect_host(node)`."""
        self.ledger.change_ref(node, "host_ref", -1)

    def pin(self, node: TreeNode) -> None:
        """Keep the L2 pages from `node` to the root whatever the load (a pinned prefix);
        L1 eviction may still demote them to L2."""
        self.ledger.change_ref(node, "pin_ref", 1)

    def unpin(self, node: TreeNode) -> None:
        """Undo one `pin(node)`."""
        self.ledger.change_ref(node, "pin_ref", -1)

    # ---- eviction (the policy is tree_eviction; these are its mechanisms) -----------------
    def evict_device(self, num_pages: int) -> EvictResult:
        """Free at least `num_pages` L1 pages (tree_eviction.evict_device says how)."""
        return tree_eviction.evict_device(self, num_pages)

    def evict_host(self, num_pages: int) -> EvictResult:
        """Free at least `num_pages` L2 pages of runs already evicted from L1."""
        return tree_eviction.evict_host(self, num_pages)

    def record_write_back(self, node: TreeNode, host_pages: list[int]) -> None:
        """An L1 run about to be evicted was copied to L2 at `host_pages` (write_back)."""
        node.host_value = list(host_pages)
        self._emit(CacheEventKind.STORED, CacheTier.HOST, node)

    def demote(self, node: TreeNode) -> None:
        """Free the L1 pages of a run that has an L2 copy; it stays matchable from L2."""
        self._emit(CacheEventKind.DEMOTED, CacheTier.DEVICE, node)
        self._account(node, -1)
        self.device_allocator.free(node.value)
        node.value = None
        self._account(node, +1)
        node.parent.device_children -= 1
        self._refresh(node.parent)
        self.ledger.host_lru.refresh(node)

    def drop_subtree(self, node: TreeNode) -> None:
        """Remove `node` (in L1, no L2 copy) and its L2-only descendants from every tier."""
        stack = list(node.children.values())
        while stack:
            below = stack.pop()
            stack.extend(below.children.values())
            self._forget(below)
        self._forget(node)
        parent = node.parent
        del parent.children[node.key[: self.page_size]]
        parent.device_children -= 1
        self._refresh(parent)
        self._drop_root_if_empty(parent)

    def remove_host_leaf(self, node: TreeNode) -> None:
        """Remove an L2-only leaf and free its L2 pages."""
        self._forget(node)
        parent = node.parent
        del parent.children[node.key[: self.page_size]]
        self.ledger.host_lru.refresh(parent)
        self._drop_root_if_empty(parent)

    def _forget(self, node: TreeNode) -> None:
        """Free `node`'s pages in both tiers and take it out of the queues."""
        if node.value is not None:
            self._emit(CacheEventKind.EVICTED, CacheTier.DEVICE, node)
        if node.host_value is not None:
            self._emit(CacheEventKind.EVICTED, CacheTier.HOST, node)
        self._account(node, -1)
        if node.value is not None:
            self.device_allocator.free(node.value)
            node.value = None
        if node.host_value is not None:
            self.host_allocator.free(node.host_value)
            node.host_value = None
        self.ledger.discard(node)
        self.ledger.num_nodes -= 1

    # ---- load-back -----------------------------------------------------------------------
    def restore_to_device(self, nodes: list[TreeNode], pages: list[int]) -> None:
        """Give L2-only `nodes` (a path, root side first) the L1 `pages`, in order."""
        start = 0
        for n in nodes:
            count = len(n.host_value)
            self._account(n, -1)
            n.value = pages[start : start + count]
            self._account(n, +1)
            self._emit(CacheEventKind.STORED, CacheTier.DEVICE, n)
            n.parent.device_children += 1
            self._refresh(n.parent)
            self._refresh(n)
            start += count

    def undo_restore(self, nodes: list[TreeNode]) -> None:
        """A load into `nodes`' L1 pages failed: they leave L1 (partial data), their L2 copies
        stay. Deepest first, so a parent loses its L1 pages after its children."""
        for n in reversed(nodes):
            if n.value is not None:
                self.demote(n)

    # ---- whole tree ----------------------------------------------------------------------
    def nodes(self) -> list[TreeNode]:
        """Every node but the roots (walks the tree: attach, detach, audits and tests)."""
        return [n for root in self._roots.values() for n in root.descendants()]

    def clear(self) -> None:
        """Drop every unlocked page; raises when something is still locked, protected or
        pinned."""
        held = [n for n in self.nodes() if n.lock_ref or n.host_ref or n.pin_ref]
        if held:
            raise CacheUsageError(f"clear() with {len(held)} locked, protected or pinned nodes, "
                                  f"e.g. {held[0]}")
        for node in self.nodes():
            self._forget(node)
        self.root.children.clear()
        self.root.device_children = 0
        self._roots = {"": self.root}
