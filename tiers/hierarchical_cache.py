"""HierarchicalCache: one rank's L1/L2 cache behind a small request-level facade.

It owns the pools (and their page allocators), the tree and the controller, applies the write
policy, plans load-back and keeps the counters. Callers see `lookup -> allocate -> (compute) ->
finish` and a few named methods (peek, release_pages, evict_*, audit); never the tree or an
allocator.

L3: attaching a backend (with the L2 relayout L3 needs and a hybrid model's sliding-window
pool) and prefetching into L2 (with the L1-only runs it must stage first) work on the same
tree, pools and counters as the request path, so they live here too. The L3 tier
(storage_tier) owns the prefetch tickets; the cache hands them through.

Swap: the engine retracts a decoding request under L1 pressure (kvtier.engine.retraction):
its KV pages, the partial last one included, are copied into L2 pages the request then holds,
outside the tree, until they are copied back into fresh L1 pages or given back. Pages come
from the host pool's allocator like every L2 page (evicting the tree's unprotected L2 runs for
room), so `audit` counts them as stray while a request holds them and as nothing once it
gives them back: a leak shows there. Why outside the tree: the tree keeps whole pages of a
token prefix, shared and evictable; a retracted request's copy includes its partial last page
and must survive until the request resumes, whatever eviction does. Its whole pages also go
to the tree when it leaves L1, as on any release (and from there to L3 under the write
policy); this copy is only the request's.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch

from kvtier.backends.base import KV_POOL, StorageBackend, StorageTarget
from kvtier.backends.registry import create_backend
from kvtier.config import HiCacheConfig
from kvtier.errors import CacheUsageError, TransferError
from kvtier.keys import KeyNamespace, PageCompute, layout_fingerprint
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.policies import (CacheEventKind, CacheTier, HostMode, StorageBackendKind,
                             WritePolicy)
from kvtier.tiers.cache_event_feed import CacheEventFeed, CacheEventListener
from kvtier.tiers.cache_pins import CachePins
from kvtier.tiers.cache_types import (CacheAudit, CacheCounters, CacheLookup, CacheSnapshot,
                                      L3Snapshot, PrefixPeek)
from kvtier.tiers.controller import CacheController
from kvtier.tiers.device_pool import DevicePool
from kvtier.tiers.host_copies import HostCopies
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.load_back import plan_load_back
from kvtier.tiers.page_exchange import PageExchange
from kvtier.tiers.peer_fetch import PeerPages
from kvtier.tiers.peer_table import PeerTable, VerifiedSums
from kvtier.tiers.radix_tree import HiRadixTree
from kvtier.tiers.sliding_kv import SlidingKV
from kvtier.tiers.sliding_l3 import SlidingL3
from kvtier.tiers.storage_tier import StorageTier
from kvtier.tiers.storage_types import PageDirectoryClient, PrefetchTicket
from kvtier.tiers.tree_node import STORED, TreeNode
from kvtier.tiers.tree_types import EvictResult, LoadBackPlan, LoadRefusal, TreeStats

log = logging.getLogger(__name__)


def depth(node: TreeNode) -> int:
    """Tokens of the prefix `node` ends."""
    return sum(len(n.key) for n in node.path_to_root())


class HierarchicalCache:
    """L1 + L2 for one TP rank, L3 when a backend is attached, and the L2 copies requests
    hold of their own KV (swap; see the module docstring). Single-threaded use; the
    controller does the copying."""

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
        self.exchange = PageExchange(self.device_pool, self.host_pool)  # for a hand-off
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
        self.copies = HostCopies(self.controller, self.tree, self._count_failed_backup,
                                 spec.page_size, self.sliding)
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
        self._peers: tuple[PeerPages, str] | None = None  # attach_peers' reader and holder
        self._built_directory = directory  # the L3 namespace's directory given at build
        self.directory = directory  # that of the L3 attached (attach_storage)
        self.events = CacheEventFeed(self.namespace, spec.page_size)
        self._table: PeerTable | None = None  # publish_l2's
        # sums of L2 pages a peer read verified (tiers/peer_pages.py), for _publish
        self.peer_sums = VerifiedSums()
        self._host_on_free = self.host_pool.allocator.on_free
        self.host_pool.allocator.on_free = self._host_freed
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
                self.counters.count_unloaded(plan, m.host_hit_length)
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
        return CacheLookup(len(tokens), pages, len(m.device_indices) * p, m.host_hit_length,
                           loaded, hold, _node=node, _load=load, _loaded_node=loaded_node)

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

    def finish(self, lookup: CacheLookup, tokens: Sequence[int], pages: Sequence[int]) -> None:
        """Store the request's KV pages (`pages` cover all of `tokens`), release the lookup."""
        res = self.tree.insert(tokens, pages, lookup._node.salt)
        self.device_pool.allocator.free(res.unused_pages)
        self._release(lookup)
        if self.config.write_through_hit_threshold == 1:
            self._back_up_path(res.last_node, 1)

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
        res = self.tree.insert(tokens[:full * page], pages[:full], lookup._node.salt)
        self.tree.lock(res.last_node)
        self.tree.unlock(lookup._node)
        if self.config.write_through_hit_threshold == 1:
            self._back_up_path(res.last_node, 1)
        return dataclasses.replace(lookup, _node=res.last_node)

    def abort(self, lookup: CacheLookup, new_pages: Sequence[int] = ()) -> None:
        """Give back everything a request held: its fresh pages and its locks."""
        self.device_pool.allocator.free(new_pages)
        self._release(lookup)

    def _release(self, lookup: CacheLookup) -> None:
        if lookup._load is not None:
            nodes = self._loading.pop(lookup._load.op_id, [])
            try:
                lookup._load.wait()
            except TransferError as exc:  # the L1 pages hold partial data: nobody may read them
                log.warning("an L2->L1 load failed (%s); its %d runs leave L1 (their L2 copies "
                            "stay) and the requests that used them are recomputed", exc,
                            len(nodes))
                self.tree.undo_restore(nodes)
                self.counters.failed_load_tokens += lookup.host_loaded_length
                nodes = []
                self._mark_unreadable(lookup._load.op_id, None)
            self.tree.release_host(lookup._loaded_node)
            self._unstage(nodes)
        if lookup.sliding is not None:
            self.sliding.end(lookup.sliding)
        self.tree.unlock(lookup._node)

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
        self.copies.start(n, host_pages,
                          self.events.node_hashes(n) if self._wants_hashes else None)
        self.counters.backed_up_tokens += len(n.key)
        return True

    def _count_failed_backup(self, tokens: int) -> None:
        """L1->L2 copies of `tokens` failed (their runs stay in L1 only)."""
        self.counters.failed_backup_tokens += tokens

    def _write_back(self, node: TreeNode) -> list[int] | None:
        """write_back policy: copy an evicted L1 run to L2 before its pages are freed."""
        host_pages = self._alloc_host(len(node.value))
        if host_pages is None:
            self.counters.dropped_backup_tokens += len(node.key)
            return None
        if not self.copies.copy_now(node.value, host_pages):  # dropped instead of demoted
            self.host_pool.allocator.free(host_pages)
            self._count_failed_backup(len(node.key))
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
            if self._table is not None and copy.hashes:
                self._publish(copy.host_pages, copy.hashes)
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

    # ---- L3: attach, detach, prefetch into L2 (the L3 tier owns the tickets) ------------

    def attach_storage(self, backend: StorageBackend | None,
                       directory: PageDirectoryClient | None = None,
                       confirm_return: bool = False) -> None:
        """Use `backend` as L3 (takes ownership: detach closes it). `directory`: the L3
        namespace's page directory that gates its hits and hears what this rank stored
        (None: the one the cache was built with, if any). `confirm_return`: a directory
        that answers again after failing is trusted only once the owner calls
        `l3_directory_back` (a namespace actor may come back without the namespace:
        storage_tier). `backend` None: the namespace's directory alone, no storage (L3 off,
        peers on: `attach_peers`)."""
        if not self.hierarchical:
            raise CacheUsageError("the hierarchical cache is off (L1 only): L3 needs L2 to "
                                  "stage its pages; enable it to attach a backend")
        if self.storage is not None:
            raise CacheUsageError("an L3 backend is already attached; detach it first")
        if backend is None and directory is None:
            raise CacheUsageError("L3 without storage is its namespace's directory alone: "
                                  "give the directory")
        self.use_head_major_host()  # L3 moves one run of bytes per KV head
        if backend is not None:
            backend.register_pool(KV_POOL, self.host_pool)
        sliding = (SlidingL3(backend, self.host_pool.sidecar, self.tree, self.spec.window_pages,
                             self.config.storage_batch_pages)
                   if self.sliding is not None and backend is not None else None)
        self.directory = directory if directory is not None else self._built_directory
        self.storage = StorageTier(backend, self.tree, self.host_pool.allocator, self.config,
                                   self.namespace, self._alloc_host,
                                   directory=self.directory, sliding=sliding)
        self.storage.confirm_return = confirm_return
        if self._peers is not None:  # peers outlive an L3 re-attach (a moved namespace)
            self.storage.attach_peers(*self._peers)
        if backend is None:
            log.info("L3 namespace attached without its storage (its directory only)")
        else:
            log.info("L3 attached: %s (%s)", backend.kind, backend.capabilities)
        self._back_up_host_pages()  # what L2 holds goes to the new backend too

    def attach_peers(self, reader: PeerPages, holder: str) -> None:
        """Prefetch from peers' L2 too (tiers/peer_fetch.py), through `reader`, as L2 holder
        `holder`: what a peer holds past the local hit, when L3 has fewer of those pages.
        Kept across L3 re-attaches; needs L3's page directory, which lists the holders."""
        if self.storage is None:
            raise CacheUsageError("peer-to-peer L2 finds holders through the L3 namespace's "
                                  "directory: attach L3 first")
        self.storage.attach_peers(reader, holder)
        self._peers = (reader, holder)

    def detach_peers(self) -> None:
        self._peers = None
        if self.storage is not None:
            self.storage.detach_peers()

    def use_head_major_host(self) -> None:
        """Hold L2 in `page_head` from now on (L3 and a hand-off across TP sizes move one run
        of bytes per KV head), after the copies in flight have landed."""
        self.flush()  # back up only L2 copies that have landed (and drop the ones that failed)
        layout = self.host_pool.layout.with_l3()
        if layout is not self.host_pool.layout:
            self.host_pool.relayout(layout)
            self.config = dataclasses.replace(self.config, mem_layout=layout)

    def storage_emptied(self) -> None:
        """The attached L3 was emptied behind this rank (its namespace purged): nothing is
        believed stored any more and what L2 holds is backed up again; prefetches go on."""
        if self.storage is None:
            return
        self.flush()
        self.storage.forget_reports()  # written before the purge: gone with it
        self.tree.l3.forget_storage()
        self._back_up_host_pages()

    def _back_up_host_pages(self) -> None:
        for node in self.tree.nodes():
            if node.host_value is not None:
                self._back_up_to_storage(node)

    def detach_storage(self) -> None:
        """Stop using L3: open prefetches are dropped, queued backups finish, nothing leaks."""
        if self.storage is None:
            return
        self.flush()
        self.storage.close()  # aborts its open prefetches first
        self.storage = None
        self.directory = self._built_directory
        self.events.tell_stored()
        self.tree.l3.forget_storage()

    @property
    def l3_attached(self) -> bool:
        return self.storage is not None

    @property
    def l3_kind(self) -> StorageBackendKind | None:
        """The attached L3 backend's kind (None: no L3)."""
        backend = None if self.storage is None else self.storage.backend
        return None if backend is None else backend.kind

    @property
    def l3_directory_away(self) -> bool:
        """A call to the attached L3's page directory failed since it last answered."""
        return self.storage is not None and self.storage.directory_away

    def l3_directory_failed(self, call: str, exc: BaseException) -> None:
        """A directory call the owner made for this L3 (`call`, in words) failed: the
        directory is away (L3 misses, stored pages unreported) until it answers."""
        if self.storage is not None:
            self.storage.directory_failed(call, exc)

    def l3_directory_back(self) -> None:
        """The owner saw the namespace as it attached it (`confirm_return`): what waited is
        reported."""
        if self.storage is not None:
            self.storage.directory_back()

    def extend_l3_pins(self, pin_ids: Sequence[str]) -> None:
        """Extend in L3 the pins `pin_ids` (hits here extended them; a hit in L2 never asks
        L3), through the attached L3's page directory; nothing without one. Raises what the
        directory raises."""
        if pin_ids and self.storage is not None and self.directory is not None:
            self.directory.refresh_pins(self.namespace.name, list(pin_ids))

    def prefetch(self, tokens: Sequence[int], retry: bool = False,
                 salt: str = "") -> PrefetchTicket | None:
        """Start fetching from L3 what this rank lacks locally (None: nothing worth fetching).
        `retry`: the request asked before and found too little (see StorageTier.prefetch).
        `salt`: the request's cache salt (its pages' keys are of that salt's chain).

        It starts past the deeper of the L1 and L2 matches, so a page in L1 is never read
        from L3 again. The pages that land can only hang below the root or a node in L2 (the
        tree's rule: an L2-only run is complete in L2), so when the match ends in runs that
        are in L1 only (write_back, storage_only, a dropped copy), those runs are copied to
        L2 as the prefetch starts: an L1->L2 copy costs a fraction of the L3 read it saves,
        and it lands long before the read. Without L2 room for them the prefetch is dropped
        (nothing it brings could be placed)."""
        if self.storage is None:
            return None
        self.poll()
        m = self.tree.match_prefix(tokens, touch=False, salt=salt)
        anchor = max(m.last_device_node, m.last_host_node, key=depth)  # one path: the deeper
        ticket = self.storage.prefetch(tokens, depth(anchor) // self.spec.page_size, anchor,
                                       retry)
        if ticket is not None and not self._stage_below_l3(anchor):
            self.storage.abort(ticket)
            return None
        return ticket

    def _stage_below_l3(self, anchor: TreeNode) -> bool:
        """Give the L1-only runs that end the path to `anchor` L2 copies (root side first),
        so that L3 pages can hang below it; False when L2 has no room for them."""
        tail = []
        node = anchor
        while node.parent is not None and node.host_value is None:
            tail.append(node)
            node = node.parent
        return all(self._copy_to_host(n) for n in reversed(tail))

    def prefetch_ready(self, ticket: PrefetchTicket, at_admission: bool = False) -> bool:
        """May the request stop waiting for its prefetch? `at_admission`: admission has
        reached it (a best_effort prefetch ends there)."""
        return (ticket.finished or self.storage is None
                or self.storage.ready(ticket, at_admission=at_admission))

    def finish_prefetch(self, ticket: PrefetchTicket, max_pages: int | None = None) -> int:
        """Insert what landed into L2 (at most `max_pages` pages: what every TP rank landed);
        returns the storage hit length (tokens)."""
        if ticket.finished or self.storage is None:
            return 0
        return self.storage.finish(ticket, max_pages)

    def abort_prefetch(self, ticket: PrefetchTicket) -> None:
        if not ticket.finished and self.storage is not None:
            self.storage.abort(ticket)

    # ---- a request's own L2 copy: swap out of L1 and back in ----------------------------

    @property
    def can_swap(self) -> bool:
        """Whether requests may swap at all: there is an L2, and the model is not hybrid (a
        hybrid model's sliding-window KV lives in sidecars whose L2 side keeps only cached
        windows, evictable at any time; swapping it would need slots held for the request,
        which the sidecar does not offer, so such requests are recomputed instead)."""
        return self.hierarchical and self.sliding is None

    def swap_out(self, device_pages: Sequence[int]) -> list[int] | None:
        """Copy `device_pages` of L1 into fresh L2 pages the caller then holds (one per page,
        in order) and wait for the copy; None (nothing held) when L2 has no room for them
        or the copy failed. The L1 pages may be freed as soon as this returns."""
        if not self.can_swap or not device_pages:
            return None
        host_pages = self._alloc_host(len(device_pages))
        if host_pages is None:
            return None
        if not self.copies.copy_now(device_pages, host_pages):
            log.warning("swapping %d pages out to L2 failed; the request is recomputed",
                        len(device_pages))
            self.host_pool.allocator.free(host_pages)
            return None
        return host_pages

    def swap_in(self, host_pages: Sequence[int],
                device_pages: Sequence[int]) -> bool:
        """Copy the caller's L2 pages into L1 pages it holds (one per page, in order) and
        wait until they landed; False when the copy failed (the L1 pages hold partial data:
        give them back). The L2 pages stay held: `free_swapped` gives them back."""
        handle = self.controller.load(host_pages, device_pages)
        try:
            handle.wait()
        except TransferError as exc:
            log.warning("swapping %d pages back into L1 failed (%s)", len(host_pages), exc)
            return False
        if self.device_pool.device.type == "cuda":
            # wait() orders the compute stream after the load; the L2 pages may be reused
            # once this returns, so the copy itself must be over.
            torch.cuda.current_stream(self.device_pool.device).synchronize()
        return True

    def free_swapped(self, host_pages: Sequence[int]) -> None:
        """Give back L2 pages from `swap_out`."""
        self.host_pool.allocator.free(host_pages)

    def bare_lookup(self, num_tokens: int, salt: str = "") -> CacheLookup:
        """A lookup that matched nothing under `salt` (it locks only the salt's root): what a
        request whose KV came back from its own L2 copy hands to `commit`, `finish` or
        `abort`, which store its pages under that salt."""
        node = self.tree.root_of(salt)
        self.tree.lock(node)
        return CacheLookup(num_tokens, [], 0, 0, 0, _node=node)

    # ---- cache events (for the router) ------------------------------------------------------
    def set_event_listener(self, fn: CacheEventListener | None) -> None:
        """Call `fn(kind, tier, page_hashes)` whenever pages enter or leave a tier (None: stop).

        Page hashes are this cache's chain keys (`self.namespace.page_hashes`), the ones a
        router computes from a request's tokens. L2 entries are told when the copy has landed,
        L3 ones when this rank's backup has written them (with a page directory, the page is
        published once every KV head is stored). With no listener the tree skips all of this.
        """
        self.events.listener = fn
        self._follow_tree()
        if fn is None:
            if self._table is None:
                self.copies.clear_hashes()
            self.events.forget()

    @property
    def _wants_hashes(self) -> bool:
        """Whether L2 copies take their pages' hashes (for the events or the peer table)."""
        return self.events.active or self._table is not None

    def _follow_tree(self) -> None:
        """Hear the tree's changes while the events or a peer table want them."""
        self.tree.listener = self._on_tree_event if self._wants_hashes else None

    def _on_tree_event(self, kind: CacheEventKind, tier: CacheTier, node: TreeNode) -> None:
        if self._table is None or kind is not CacheEventKind.STORED or \
                tier is not CacheTier.HOST or self.copies.in_flight(node.host_value):
            self.events.on_tree_event(kind, tier, node)
            return
        hashes = self.events.node_hashes(node)  # once, for the listener and the table
        self.events.on_tree_event(kind, tier, node, hashes)
        self._publish(node.host_value, hashes)

    # ---- peer-to-peer L2: the table of what L2 holds (tiers/peer_table.py) -----------------
    def publish_l2(self, table: PeerTable | None) -> None:
        """List in `table`, from now on, every L2 page of the tree whose copy has landed: its
        key and its sums per KV head, written once it landed and cleared when it leaves L2,
        before the page is reused (None: stop). Peers read the table instead of asking this
        rank (tiers/peer_table.py). L2 must be in `page_head` (use_head_major_host)."""
        if table is not None and (table.num_pages, table.heads) != \
                (self.host_pool.num_pages, self.spec.num_kv_heads):
            raise CacheUsageError(f"a peer table of {table.num_pages} pages and {table.heads} "
                                  f"heads for an L2 of {self.host_pool.num_pages} pages and "
                                  f"{self.spec.num_kv_heads} heads")
        self.flush()
        self._table = table
        self._follow_tree()
        if table is None:
            if not self.events.active:
                self.copies.clear_hashes()
            return
        for node in self.tree.nodes():  # what L2 holds already
            if node.host_value is not None and node.parent is not None:
                self._publish(node.host_value, self.events.node_hashes(node))

    def _publish(self, pages: Sequence[int], keys: Sequence[str]) -> None:
        table = self._table
        heads = range(table.heads)
        sums = self.peer_sums.sums(pages, table.heads,
                                   lambda missing: self.exchange.l2_head_sums(missing, heads))
        table.publish(pages, keys, sums)

    def _host_freed(self, pages: list[int]) -> None:
        """The host allocator's `on_free`: freed L2 pages leave the peer table before anything
        can take them again (this thread both frees and allocates them), and so do the sums a
        peer read left for them."""
        if self._table is not None:
            self._table.clear(pages)
        self.peer_sums.drop(pages)
        if self._host_on_free is not None:
            self._host_on_free(pages)

    def await_prefetch(self, timeout_s: float) -> bool:
        """Block (the GIL released) until an open prefetch ends or `timeout_s` passed; whether
        one did (False at once when none is open). Nothing is settled: `poll` does that."""
        return self.storage is not None and self.storage.await_prefetch(timeout_s)

    def flush(self) -> None:
        """Wait for every queued copy and settle its bookkeeping (failed copies included)."""
        self.copies.wait()
        self.poll()

    def quiesce(self) -> None:
        """`flush`, then wait for the queued L2->L3 backups: nothing runs in the background
        after this (before a timed request, an audit, a measurement)."""
        self.flush()
        if self.storage is not None:
            self.storage.drain()

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

    @property
    def host_pages(self) -> int:
        """L2 capacity in pages."""
        return self.host_pool.num_pages

    def snapshot(self) -> CacheSnapshot:
        """The counters and pool use now (copies), L3's included when attached."""
        l3 = None
        if self.storage is not None and self.storage.backend is not None:
            backend = self.storage.backend
            l3 = L3Snapshot(backend.kind, dataclasses.replace(backend.stats()),
                            dataclasses.replace(self.storage.counters))
        return CacheSnapshot(self.spec.page_size, dataclasses.replace(self.counters),
                             self.controller.stats(), self.device_pages,
                             self.free_device_pages, self.host_pages, self.used_host_pages,
                             self.host_pool.pinned, l3, _sidecar_used(self.host_pool),
                             _sidecar_used(self.device_pool))

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


def _sidecar_used(pool: HostPool | DevicePool) -> int:
    """Sliding-window KV slots in use in `pool`'s sidecar (0 without one)."""
    return pool.sidecar.used_slots if pool.sidecar is not None else 0
