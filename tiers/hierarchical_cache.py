"""HierarchicalCache: one rank's L1/L2 cache behind a small request-level facade.

It owns the pools (and their page allocators), the tree and the controller, applies the write
policy, plans load-back and keeps the counters. Callers see `lookup -> allocate -> (compute) ->
finish` and a few named methods (peek, release_pages, evict_*, audit); never the tree or an
allocator. The L3 tier (storage_tier) owns the prefetch tickets; the cache hands them through.
"""
from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from kvtier.backends.base import StorageBackend, StorageTarget
from kvtier.backends.registry import create_backend
from kvtier.config import HiCacheConfig
from kvtier.errors import CacheUsageError, TransferError
from kvtier.keys import KeyNamespace, PageCompute, layout_fingerprint
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.policies import HostMode, WritePolicy
from kvtier.tiers.cache_event_feed import CacheEventFeed, CacheEventListener
from kvtier.tiers.cache_l3 import CacheL3, depth
from kvtier.tiers.cache_pins import CachePins
from kvtier.tiers.cache_swap import CacheSwap
from kvtier.tiers.cache_types import CacheAudit, CacheCounters, CacheLookup, PrefixPeek
from kvtier.tiers.controller import CacheController
from kvtier.tiers.device_pool import DevicePool
from kvtier.tiers.host_copies import HostCopies
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.load_back import plan_load_back
from kvtier.tiers.radix_tree import HiRadixTree
from kvtier.tiers.sliding_kv import SlidingKV
from kvtier.tiers.storage_tier import StorageTier
from kvtier.tiers.storage_types import PageDirectoryClient
from kvtier.tiers.tree_node import STORED, TreeNode
from kvtier.tiers.tree_types import EvictResult, LoadBackPlan, LoadRefusal, TreeStats

log = logging.getLogger(__name__)


class HierarchicalCache(CacheL3, CacheSwap):
    """L1 + L2 for one TP rank (and L3: CacheL3; a request's own L2 copy: CacheSwap).
    Single-threaded use; the controller does the copying."""

    def __init__(self, config: HiCacheConfig, spec: KVSpec, device_pages: int,
                 device: torch.device | str | None = None, model: str = "kvtier-model",
                 tenant_salt: str = "", storage: StorageBackend | None = None,
                 tp_rank: int = 0, tp_size: int = 1,
                 directory: PageDirectoryClient | None = None,
                 deterministic: bool = False) -> None:
        """`directory`: the L3 namespace's page directory; with it, L3 hits are the pages it
        has published and this rank reports what its backups wrote (None: ask the backend).
        `deterministic`: the pages are an Engine's in deterministic mode, keyed apart from
        batched ones (kvtier.keys.PageCompute); the Engine checks it agrees."""
        config = config.normalize()
        if spec.page_size != config.page_size:
            raise CacheUsageError(
                f"the KV spec has page size {spec.page_size} but the config says "
                f"{config.page_size}; build both from the same --page-size")
        self.config = config
        self.spec = spec
        self.device_pool = DevicePool(spec, device_pages, device)
        size_gb = config.hicache_size_gb if config.hicache_size_gb > 0 else None
        # Hierarchy off (--disable-hierarchical-cache): L1 only, the radix cache as in a plain
        # engine; a one-page L2 that is never used keeps one code path.
        self.hierarchical = config.enable_hierarchical_cache
        self.host_pool = (HostPool.for_device(self.device_pool, config.mem_layout,
                                              ratio=config.hicache_ratio or 0.0, size_gb=size_gb)
                          if self.hierarchical else HostPool(spec, 1, config.mem_layout))
        self.controller = CacheController(self.device_pool, self.host_pool, config.io_backend)
        self.tree = HiRadixTree(
            spec.page_size, self.device_pool.allocator, self.host_pool.allocator,
            write_back=self._write_back if (self.hierarchical and config.write_policy is
                                            WritePolicy.WRITE_BACK) else None,
        )
        self.counters = CacheCounters()
        # a hybrid model's sliding-window layers: their KV in sidecars of both pools
        self.sliding = (SlidingKV(self.device_pool.sidecar, self.host_pool.sidecar,
                                  spec.window_pages, spec.page_size, spec.sliding.window,
                                  config.io_backend)
                        if spec.sliding is not None else None)
        self.copies = HostCopies(self.controller, self.tree, self.counters, spec.page_size,
                                 self.sliding)
        self._loading: dict[int, list[TreeNode]] = {}  # load op id -> runs it restores to L1
        self._failed_loads: dict[int, frozenset[int]] = {}  # load op id -> its L1 pages, from
        # when a forward found it failed until its lookup is released (the pages leave L1)
        self._unreadable: frozenset[int] = frozenset()  # their union
        self._written_back: list[TreeNode] = []  # L2 copies made on eviction, for L3 backup
        # This rank's KV heads of the model's: L3 objects name global heads, so any TP size
        # of the same model shares them (the fingerprint holds the total, not the share).
        self.heads = HeadRange.of_rank(spec.num_kv_heads * tp_size, tp_rank, tp_size)
        self.deterministic = deterministic
        compute = PageCompute(deterministic, tp_size, self.device_pool.device.type)
        self.namespace = KeyNamespace(model, tenant_salt,
                                      layout_fingerprint(spec, self.heads.total, compute=compute))
        self.pins = CachePins(self.tree, self.host_pool.num_pages, self._copy_to_host,
                              self.flush, sidecar=self.host_pool.sidecar,
                              window_pages=spec.window_pages)
        self.storage: StorageTier | None = None
        self.directory = directory
        self.events = CacheEventFeed(self.namespace, spec.page_size)
        if storage is None and config.storage_backend is not None:
            target = StorageTarget(self.namespace, self.heads)
            storage = create_backend(config.storage_backend, target, config.storage_options)
        if storage is not None:
            self.attach_storage(storage)
        log.info("hierarchical cache: %s; L1 %d pages, L2 %d pages", config.describe(),
                 self.device_pool.num_pages, self.host_pool.num_pages)

    # ---- request path --------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], max_load_pages: int | None = None,
               salt: str = "") -> CacheLookup:
        """Match `tokens` among the prefixes of cache salt `salt` (a tenant's: prefixes of
        other salts never match), load back what L2 holds (within `max_load_pages`), lock the
        result. `finish`, `commit` and `abort` keep the salt the lookup was made with."""
        self.poll()
        p = self.spec.page_size
        m = self.tree.match_prefix(tokens, salt=salt)
        if self.pins:  # a hit on pinned pages extends their pins
            self.pins.on_hit(max(m.last_device_node, m.last_host_node, key=depth))
        node, pages = m.last_device_node, list(m.device_indices)
        load = loaded_node = None
        loaded = 0
        if m.host_hit_length:  # in storage_only mode too: L3 pages arrive through L2
            plan = self._plan_load_back(m.last_host_node, max_load_pages)
            if isinstance(plan, LoadRefusal):
                name = f"unloaded_{plan.value}_tokens"
                setattr(self.counters, name, getattr(self.counters, name) + m.host_hit_length)
            else:
                loaded_node = node = plan.nodes[-1]
                self.tree.protect_host(loaded_node)
                load = self.controller.load(plan.host_pages, plan.device_pages)
                if self.sliding is not None:
                    self.sliding.load_to_device(plan.host_pages, plan.device_pages)
                self._loading[load.op_id] = plan.nodes
                pages += plan.device_pages
                loaded = plan.num_tokens
                self.counters.loaded_back_tokens += loaded
        self.tree.lock(node)
        self.counters.lookups += 1
        self.counters.device_hit_tokens += len(m.device_indices) * p
        self.counters.host_hit_tokens += m.host_hit_length
        threshold = self.config.write_through_hit_threshold
        if threshold is not None and threshold > 1:
            self._back_up_path(node, threshold)
        hold = self.sliding.hold_hit(pages) if self.sliding is not None else None
        return CacheLookup(len(tokens), pages, node, len(m.device_indices) * p,
                           m.host_hit_length, loaded, load, loaded_node, hold)

    def window_check(self, lookup: CacheLookup) -> Callable[[int], bool] | None:
        """For a hybrid model: whether a hit of the lookup's first n tokens (whole pages) has
        its trailing window's sliding-window KV in L1 (None: a plain model, any length goes)."""
        if self.sliding is None:
            return None
        sliding, pages, p = self.sliding, lookup.device_pages, self.spec.page_size
        return lambda n: sliding.window_ok(pages, n // p)

    def trim_sliding(self, lookup: CacheLookup, used_pages: int) -> None:
        """The request uses the first `used_pages` pages of its hit: hold only their window.
        Raises CacheUsageError when that window lacks sliding-window KV here (TP ranks that
        agreed on a length this rank cannot serve)."""
        if self.sliding is None or lookup.sliding is None:
            return
        if not self.sliding.window_ok(lookup.device_pages, used_pages):
            raise CacheUsageError(
                f"the agreed hit of {used_pages} pages lacks sliding-window KV on this rank; "
                f"its ranks' caches diverged (a failed copy on one of them)")
        self.sliding.trim_hit(lookup.sliding, lookup.device_pages, used_pages)

    def _plan_load_back(self, node: TreeNode, max_pages: int | None) -> LoadBackPlan | LoadRefusal:
        plan = plan_load_back(self.tree, node, self.config.load_back_threshold_tokens, max_pages)
        if plan is LoadRefusal.DEVICE_CAPACITY and self.copies:
            self.flush()  # L1 runs held only by copies in flight become evictable
            plan = plan_load_back(self.tree, node, self.config.load_back_threshold_tokens, max_pages)
        return plan

    def allocate(self, num_pages: int) -> list[int] | None:
        """`num_pages` fresh L1 pages, evicting as needed; None when L1 cannot make room."""
        alloc = self.device_pool.allocator
        pages = alloc.alloc(num_pages)
        if pages is None:
            self.poll()
            self.evict_device(num_pages - alloc.num_free)
            pages = alloc.alloc(num_pages)
        if pages is None and self.copies:  # runs held only by copies still in flight
            self.flush()
            self.evict_device(num_pages - alloc.num_free)
            pages = alloc.alloc(num_pages)
        return pages

    def finish(self, lookup: CacheLookup, tokens: Sequence[int], pages: Sequence[int]) -> TreeNode:
        """Store the request's KV pages (`pages` cover all of `tokens`), release the lookup."""
        res = self.tree.insert(tokens, pages, lookup.node.salt)
        self.device_pool.allocator.free(res.unused_pages)
        self._release(lookup)
        if self.config.write_through_hit_threshold == 1:
            self._back_up_path(res.last_node, 1)
        return res.last_node

    def commit(self, lookup: CacheLookup, tokens: Sequence[int],
               pages: Sequence[int]) -> CacheLookup:
        """Store the whole pages of a request that keeps running (`pages` cover the whole
        pages of `tokens`, whose KV is final): they enter the tree now, and L2/L3 under the
        write policy, so other requests hit them before it ends. The request goes on reading
        its page table: its copies of pages the tree already held are freed by `finish`, not
        here, and the lock moves down to the deepest stored node. Returns the lookup to hand
        to `finish` or `abort` (the one given must not be used again)."""
        page = self.spec.page_size
        full = len(tokens) // page
        res = self.tree.insert(tokens[:full * page], pages[:full], lookup.node.salt)
        self.tree.lock(res.last_node)
        self.tree.unlock(lookup.node)
        if self.config.write_through_hit_threshold == 1:
            self._back_up_path(res.last_node, 1)
        return lookup._replace(node=res.last_node)

    def abort(self, lookup: CacheLookup, new_pages: Sequence[int] = ()) -> None:
        """Give back everything a request held: its fresh pages and its locks."""
        self.device_pool.allocator.free(new_pages)
        self._release(lookup)

    def _release(self, lookup: CacheLookup) -> None:
        if lookup.load is not None:
            nodes = self._loading.pop(lookup.load.op_id, [])
            try:
                lookup.load.wait()
            except TransferError as exc:  # the L1 pages hold partial data: nobody may read them
                log.warning("an L2->L1 load failed (%s); its %d runs leave L1 (their L2 copies "
                            "stay) and the requests that used them are recomputed", exc,
                            len(nodes))
                self.tree.undo_restore(nodes)
                self.counters.failed_load_tokens += lookup.host_loaded_length
                nodes = []
                self._mark_unreadable(lookup.load.op_id, None)
            self.tree.release_host(lookup.loaded_node)
            self._unstage(nodes)
        if lookup.sliding is not None:
            self.sliding.end(lookup.sliding)
        self.tree.unlock(lookup.node)

    # ---- write policy --------------------------------------------------------------------
    def _back_up_path(self, node: TreeNode, min_hits: int) -> None:
        """Copy to L2 every L1-only node on the path that reached `min_hits` (root first)."""
        if not self.hierarchical:
            return
        staging = self.config.host_mode is HostMode.STORAGE_ONLY
        path = [n for n in node.path_to_root() if n.host_value is None and n.value is not None
                and not (staging and n.storage_op == STORED)]  # staged only to reach L3
        for n in reversed(path):
            if min_hits > 1 and n.hit_count < min_hits:
                continue
            if not self._copy_to_host(n):
                return

    def _copy_to_host(self, n: TreeNode) -> bool:
        """Start copying L1-only `n` to L2; False when L2 has no room for it."""
        host_pages = self._alloc_host(len(n.value))
        if host_pages is None:
            self.counters.dropped_backup_tokens += len(n.key)
            return False
        # told when the copy lands (hashes now: n may split before)
        self.copies.start(n, host_pages, self.events.node_hashes(n) if self.events.active else None)
        self.counters.backed_up_tokens += len(n.key)
        return True

    def _write_back(self, node: TreeNode) -> list[int] | None:
        """write_back policy: copy an evicted L1 run to L2 before its pages are freed."""
        host_pages = self._alloc_host(len(node.value))
        if host_pages is None:
            self.counters.dropped_backup_tokens += len(node.key)
            return None
        if not self.copies.copy_now(node.value, host_pages):  # dropped instead of demoted
            self.host_pool.allocator.free(host_pages)
            self.counters.failed_backup_tokens += len(node.key)
            return None
        self.counters.written_back_tokens += len(node.key)
        if self.storage is not None:
            self._written_back.append(node)  # to L3 once the tree has recorded the copy
        return host_pages

    def _alloc_host(self, num_pages: int) -> list[int] | None:
        alloc = self.host_pool.allocator
        pages = alloc.alloc(num_pages)
        if pages is None:
            self.evict_host(num_pages - alloc.num_free)
            pages = alloc.alloc(num_pages)
        return pages

    # ---- housekeeping --------------------------------------------------------------------
    def poll(self) -> int:
        """Unlock runs whose L2 copies have landed; returns how many landed."""
        landed = self.copies.landed()
        for copy in landed:
            self.events.host_landed(copy.hashes)
            self._back_up_to_storage(copy.node)
        while self._written_back:
            self._back_up_to_storage(self._written_back.pop())
        if self.storage is not None:
            self.storage.poll()
            self._unstage(self.storage.take_stored())
        self.events.tell_stored()
        return len(landed)

    def _unstage(self, nodes: Sequence[TreeNode]) -> None:
        """storage_only: L2 holds a page only while it moves between L1 and L3. Runs that are
        in L1 and stored in L3 give their L2 copies back (L2-only runs go by L2 eviction)."""
        if self.config.host_mode is not HostMode.STORAGE_ONLY:
            return
        for node in nodes:
            for n in node.path_to_root():
                if self.tree.release_backup(n):
                    self.counters.unstaged_tokens += len(n.key)

    def _back_up_to_storage(self, node: TreeNode) -> None:
        if self.storage is not None and node.host_value is not None and node.parent is not None:
            op = self.storage.backup(node)
            self.events.backup_started(op)

    # ---- cache events (for the router) ------------------------------------------------------
    def set_event_listener(self, fn: CacheEventListener | None) -> None:
        """Call `fn(kind, tier, page_hashes)` whenever pages enter or leave a tier (None: stop).

        Page hashes are this cache's chain keys (`self.namespace.page_hashes`), the ones a
        router computes from a request's tokens. L2 entries are told when the copy has landed,
        L3 ones when this rank's backup has written them (with a page directory, the page is
        published once every KV head is stored). With no listener the tree skips all of this.
        """
        self.events.listener = fn
        self.tree.listener = self.events.on_tree_event if fn is not None else None
        if fn is None:
            self.copies.clear_hashes()
            self.events.forget()

    def flush(self) -> None:
        """Wait for every queued copy and settle its bookkeeping (failed copies included)."""
        self.copies.wait()
        self.poll()

    def evict_device(self, num_pages: int) -> EvictResult:
        """Free L1 pages now (demoting backed-up runs to L2)."""
        result = self.tree.evict_device(num_pages)
        self.counters.evicted_device_tokens += result.freed_pages * self.spec.page_size
        return result

    def evict_host(self, num_pages: int) -> EvictResult:
        """Free L2 pages now (runs already out of L1, least recently used first)."""
        result = self.tree.evict_host(num_pages)
        self.counters.evicted_host_tokens += result.freed_pages * self.spec.page_size
        return result

    def drop_unlocked(self) -> None:
        """Settle copies in flight, then evict every unlocked page of L1 and L2 (L3 stays)."""
        self.flush()
        self.evict_device(self.device_pool.num_pages)
        self.evict_host(self.host_pool.num_pages)

    # ---- what callers may know of the pools and the tree --------------------------------------
    def peek(self, tokens: Sequence[int], salt: str = "") -> PrefixPeek:
        """What `lookup` would find, without locking, loading or touching LRU order."""
        m = self.tree.match_prefix(tokens, touch=False, salt=salt)
        return PrefixPeek(m.device_hit_length, m.host_hit_length)

    def allocate_host(self, num_pages: int) -> list[int] | None:
        """`num_pages` L2 pages outside the tree (evicting cached ones as needed), e.g. to
        stage a hand-off; None when L2 cannot make room. Give them back with
        `release_host_pages`."""
        return self._alloc_host(num_pages)

    def release_host_pages(self, pages: Sequence[int]) -> None:
        self.host_pool.allocator.free(pages)

    def release_pages(self, pages: Sequence[int]) -> None:
        """Give back fresh L1 pages from `allocate` that no request or tree node kept."""
        self.device_pool.allocator.free(pages)

    @property
    def device_pages(self) -> int:
        """L1 capacity in pages."""
        return self.device_pool.num_pages

    @property
    def free_device_pages(self) -> int:
        return self.device_pool.allocator.num_free

    @property
    def used_host_pages(self) -> int:
        return self.host_pool.num_pages - self.host_pool.allocator.num_free

    def tree_stats(self) -> TreeStats:
        return self.tree.stats()

    def audit(self) -> CacheAudit:
        """Pages allocated that no tree node (or L3 read still running) holds, and nodes still
        locked: all zero once every request has ended and copies have settled."""
        nodes = self.tree.nodes()
        device = {p for n in nodes if n.value is not None for p in n.value}
        host = {p for n in nodes if n.host_value is not None for p in n.host_value}
        stray_device = len(set(self.device_pool.allocator.allocated_pages()) - device)
        stray_host = len(set(self.host_pool.allocator.allocated_pages()) - host)
        orphaned = self.storage.orphaned_pages if self.storage is not None else 0
        return CacheAudit(stray_device, max(0, stray_host - orphaned), orphaned,
                          sum(1 for n in nodes if n.lock_ref),
                          sum(1 for n in nodes if n.host_ref),
                          self.storage.open_tickets if self.storage is not None else 0)

    def wait_layer(self, layer: int) -> frozenset[int]:
        """Block until every load submitted so far has landed `layer` (call before attention).
        Returns the L1 pages nobody may read: those of loads that failed (partial data), from
        the wait that finds one failed until its lookup is released. The forward goes on and
        poisons the rows that read them (kvtier.engine.step_forwards says why)."""
        for load in self.controller.wait_layer(layer):
            log.warning("L2->L1 load %d failed (%s): %d L1 pages hold partial data until its "
                        "request is recomputed", load.op_id, load.error, load.plan.num_pages)
            self._mark_unreadable(load.op_id, frozenset(load.plan.dst_pages))
        return self._unreadable

    def _mark_unreadable(self, op_id: int, pages: frozenset[int] | None) -> None:
        """Load `op_id`'s L1 pages are unreadable (`pages`), or no longer in L1 (None)."""
        if pages is None:
            self._failed_loads.pop(op_id, None)
        else:
            self._failed_loads[op_id] = pages
        self._unreadable = frozenset().union(*self._failed_loads.values())

    def close(self) -> None:
        self.detach_storage()
        self.controller.close()
        self.host_pool.close()
        self.device_pool.close()

    def __enter__(self) -> "HierarchicalCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
