"""The L3 page directory: which pages of each namespace are complete, leased and kept.

Why a directory in front of the storage: a backend only knows what one rank stored, but a page
is usable only when EVERY KV head of it is stored (docs/architecture.md invariant 3). A page is
one object per KV head and part, named by the model's global head index, so writers of any TP
size fill it: ranks report the head range they stored, a page is published (all or nothing) once
the union covers every head, and lookups answer from published pages only. The directory also
holds the quota of each namespace, shared by all instances, and is the namespace's one eviction
authority (rank clients do not evict on their own, see page_store): least recently used pages go
first, never while a lease protects them.

Calls never delete anything themselves. `report_stored` and the lease calls only mark a
namespace as needing a pass; `eviction_pass` unpublishes the victims (quota, unfinished
pages whose writer is gone) and queues their deletes; `take_deletes` hands them out and
`deletes_done` takes the outcomes back; between the two the owner runs `store.delete`
without holding its lock (page_eviction: `run_pass`, and the service's thread). A page a
reader found missing or corrupt (`report_missing`) is unpublished and its remains queued.

Old format (objects named by TP rank, written before objects named heads; never read): a
rebuild has the store reclaim them (`PageStore.reclaim_old_format`, see backends/base) and
counts `old_format_pages_reclaimed`. `purge` empties a namespace on purpose and starts a new
epoch, which the ranks follow: they forget what they believed stored and back pages up again.

Plain Python and no Ray: the namespace actor wraps it; tests drive it with a fake clock. Not
thread-safe: its owner serializes calls. Page bytes never pass through here.
"""
from __future__ import annotations

import heapq
import logging
import secrets
import time
from dataclasses import replace
from typing import Callable, Sequence

from kvtier.backends.base import check_page_hash
from kvtier.errors import CacheUsageError, ConfigError, KvtierError, UnknownNamespaceError
from kvtier.kv_spec import HeadRange
from kvtier.messages import (DirectoryStats, L2Holding, L2Receipt, L2Standing, LeaseGrant,
                             LookupResult, NamespaceInfo, NamespaceSpec, PeerOffer, PeerRank)
from kvtier.tiers.directory_state import Lease as _Lease, NamespaceState
from kvtier.tiers.l2_holders import L2Holders
from kvtier.tiers.page_pins import L3PinListing
from kvtier.tiers.page_eviction import DELETE_BATCH_PAGES, DeleteBatch, DeleteOutcome, DeleteQueue
from kvtier.tiers.page_store import BackendPageStore, PageStore

log = logging.getLogger(__name__)

DEFAULT_PENDING_TTL_S = 600.0  # a page some ranks reported but not all: its writer is gone
DEFAULT_MAX_LEASE_S = 600.0
StoreFactory = Callable[[NamespaceInfo], PageStore]


class PageDirectory:
    """Namespaces, their published pages, leases and quotas (see the module docstring)."""

    def __init__(self, store_factory: StoreFactory = BackendPageStore,
                 clock: Callable[[], float] = time.monotonic,
                 pending_ttl_s: float = DEFAULT_PENDING_TTL_S,
                 max_lease_s: float = DEFAULT_MAX_LEASE_S) -> None:
        self._store_factory, self._clock = store_factory, clock
        self.pending_ttl_s, self.max_lease_s = pending_ttl_s, max_lease_s
        self._ns: dict[str, NamespaceState] = {}
        self._leases: dict[str, _Lease] = {}
        self._expiry: list[tuple[float, str]] = []  # heap of (expires_at, lease id)
        # Lease ids of an earlier incarnation (an actor restart) must not match new ones.
        self._lease_prefix, self._lease_seq = secrets.token_hex(4), 0
        self._deletes = DeleteQueue()

    # ---- namespaces -----------------------------------------------------------------------
    def register(self, spec: NamespaceSpec, options: dict | None = None, epoch: int = 0,
                 root_marker: str = "") -> NamespaceInfo:
        """Register a namespace (idempotent for the same spec); `options` are the resolved
        storage options ranks get (default: the spec's), `root_marker` the token of its
        shared-root marker. Opens the namespace's storage."""
        ns = spec.namespace
        current = self._ns.get(ns)
        if current is not None:
            if current.info.spec != spec:
                old, new = current.info.spec, spec
                differ = {f: (getattr(old, f), getattr(new, f)) for f in spec.__dataclass_fields__
                          if getattr(old, f) != getattr(new, f)}
                raise ConfigError(
                    f"namespace {ns} is already registered with other settings (registered, "
                    f"this one: {differ}); register the same spec, or give this one another "
                    "tenant_salt or layout_fingerprint")
            return current.info
        info = NamespaceInfo(ns, spec, dict(spec.options if options is None else options), epoch,
                             root_marker)
        self._ns[ns] = NamespaceState(info, self._store_factory(info),
                                      l2=L2Holders(clock=self._clock))
        log.info("L3 namespace %s registered: %s backend, %d KV heads, quota %s pages%s", ns,
                 spec.backend, spec.kv_heads, spec.capacity_pages or "no",
                 " (the backend's own bound, folded in: its clients do not evict)"
                 if any(spec.backend_bound) else "")
        return info

    def reattach(self, ns: str, options: dict) -> NamespaceInfo:
        """The namespace's storage was replaced (a restarted Mooncake master): new clients,
        a new epoch, and an empty directory, since what the old storage held is gone."""
        state = self._get(ns)
        info = replace(state.info, options=dict(options), epoch=state.info.epoch + 1)
        store = self._store_factory(info)
        self._deletes.retire(state.store)  # closed once no delete runs on it
        state.info, state.store = info, store
        state.published.clear()
        state.pending.clear()
        self._deletes.drop_queued(ns)  # they named objects of the storage that is gone
        log.warning("L3 namespace %s re-attached to new storage (epoch %d); its directory is "
                    "empty", ns, info.epoch)
        return info

    def info(self, ns: str) -> NamespaceInfo:
        return self._get(ns).info

    def namespaces(self) -> list[str]:
        return list(self._ns)

    # ---- pages ----------------------------------------------------------------------------
    def report_stored(self, ns: str, hashes: Sequence[str], heads: HeadRange) -> list[str]:
        """A rank stored the objects of KV heads `heads` of `hashes`; returns the pages this
        published (those whose every head is now stored)."""
        state = self._get(ns)
        total = state.info.spec.kv_heads
        if not isinstance(heads, HeadRange) or heads.total != total:
            raise CacheUsageError(f"a stored report names KV heads {heads!r}, but namespace "
                                  f"{ns} is of a model with {total} KV heads; report the heads "
                                  "of that model")
        now = self._expire()
        new: list[str] = []
        for h in map(check_page_hash, hashes):
            if h in state.published or self._deletes.doomed(ns, h):
                continue  # a doomed page's objects are about to go: ignored until they have
            stored, first = state.pending.get(h, (set(), now))
            stored.update(heads.heads())
            if len(stored) == total:
                state.pending.pop(h, None)
                state.published[h] = None
                new.append(h)
            else:
                state.pending[h] = (stored, first)
        self._touch(state, [h for h in hashes if h in state.published])
        self._check_quota(state)
        return new

    def report_missing(self, ns: str, hashes: Sequence[str]) -> int:
        """A reader found these pages missing or corrupt in the storage (deleted behind the
        directory's back, rotten): unpublish them, queue deletes of what is left of them,
        count them as vanished. Returns how many were published."""
        state = self._get(ns)
        gone = [h for h in dict.fromkeys(map(check_page_hash, hashes)) if h in state.published]
        for h in gone:
            del state.published[h]
        if gone:
            state.counters.vanished_pages += len(gone)
            self._deletes.add(ns, gone)
            log.info("L3 namespace %s: %d published pages were missing or corrupt in the "
                     "storage; unpublished", ns, len(gone))
        return len(gone)

    def lookup(self, ns: str, hashes: Sequence[str], lease_ttl_s: float = 0.0) -> LookupResult:
        """How many leading pages of `hashes` are published; with `lease_ttl_s`, lease them."""
        state = self._get(ns)
        now = self._expire()
        hits = self._leading(state, hashes)
        state.pins.on_hit(hashes[:hits], now)
        c = state.counters
        c.lookups += 1
        c.hit_pages += hits
        c.miss_pages += len(hashes) - hits
        lease_id = self._grant(state, hashes[:hits], lease_ttl_s, now) if lease_ttl_s else ""
        return LookupResult(ns, hits, lease_id)

    def lease(self, ns: str, hashes: Sequence[str], ttl_s: float) -> LeaseGrant:
        """Protect the leading published pages of `hashes` from eviction for `ttl_s`."""
        state = self._get(ns)
        now = self._expire()
        hits = self._leading(state, hashes)
        return LeaseGrant(self._grant(state, hashes[:hits], ttl_s, now), ns, hits, float(ttl_s))

    def release(self, lease_id: str) -> bool:
        """End a lease early; False when it is unknown (expired, or from before a restart)."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        self._unlease(lease)
        return True

    def rebuild(self, ns: str) -> int:
        """Repopulate from the storage's listing: pages whose parts exist for every KV head
        are published, in the listing's order (least recently used first where the backend
        can tell); partial ones wait as pending. Old-format objects of the model are reclaimed
        first (module docstring). Returns how many pages are published."""
        state = self._get(ns)
        if not state.store.listable:
            log.warning("L3 namespace %s: the %s backend cannot list its pages; the directory "
                        "starts empty", ns, state.info.spec.backend)
            return 0
        try:
            reclaimed = state.store.reclaim_old_format()
            listing = state.store.list_pages()
        except (KvtierError, OSError) as exc:
            log.error("L3 namespace %s: listing its storage failed (%s); the directory starts "
                      "empty", ns, exc)
            return 0
        if reclaimed:
            state.counters.old_format_pages_reclaimed += reclaimed
            log.warning("L3 namespace %s: deleted %d pages of an old object format (named by "
                        "TP rank); they are never read", ns, reclaimed)
        now, total = self._clock(), state.info.spec.kv_heads
        state.published.clear()
        state.pending.clear()
        for h, heads in listing.items():
            if self._deletes.doomed(ns, h):
                continue  # listed, but its delete is queued or running
            if len(heads) >= total:
                state.published[h] = None
            else:
                state.pending[h] = (set(heads), now)
        state.counters.rebuilt_pages = len(state.published)
        self._check_quota(state)
        log.info("L3 namespace %s rebuilt: %d pages published, %d partial", ns,
                 len(state.published), len(state.pending))
        return len(state.published)

    def purge(self, ns: str) -> int:
        """Empty namespace `ns` on purpose: every page it has published, pending or in the
        storage's listing is unpublished and its delete queued (the eviction pass runs it),
        leases on it end, and a new epoch starts: ranks that follow it forget what they
        believed was in L3 and back their pages up again. Returns the pages queued."""
        state = self._get(ns)
        listed: dict[str, set[int]] = {}
        try:
            listed = state.store.list_pages() if state.store.listable else {}
        except (KvtierError, OSError) as exc:
            log.error("L3 namespace %s: listing its storage for a purge failed (%s); deleting "
                      "the pages the directory knows of", ns, exc)
        doomed = [h for h in dict.fromkeys([*state.published, *state.pending, *listed])
                  if not self._deletes.doomed(ns, h)]
        state.published.clear()
        state.pending.clear()
        for lease_id in [i for i, lease in self._leases.items() if lease.namespace == ns]:
            del self._leases[lease_id]
        state.leased.clear()
        self._deletes.add(ns, doomed)
        state.counters.purged_pages += len(doomed)
        state.info = replace(state.info, epoch=state.info.epoch + 1)
        log.warning("L3 namespace %s purged: %d pages queued for deletion; epoch %d", ns,
                    len(doomed), state.info.epoch)
        return len(doomed)

    # ---- L2 holdings (l2_holders) ------------------------------------------------------------
    def report_l2(self, ns: str, holder: str, incarnation: str, held: Sequence[str],
                  dropped: Sequence[str] = (), replace: bool = False) -> L2Receipt:
        """`holder`'s `incarnation` gained `held` and lost `dropped` in its L2 (`replace`:
        held is all it holds), which renews its lease (L2Holders.apply); the pages it lists
        now and how the report was taken."""
        holders = self._get(ns).l2
        standing = holders.apply(holder, incarnation, held, dropped, replace)
        retired = standing is L2Standing.RETIRED  # the name's pages are another's
        return L2Receipt(0 if retired else holders.held_by(holder), standing)

    def forget_l2(self, holder: str, incarnation: str) -> int:
        """`holder`'s `incarnation` holds nothing any more, in any namespace (it stopped; a
        newer incarnation is left alone); the pages it listed."""
        return sum(state.l2.forget(holder, incarnation) for state in self._ns.values())

    def l2_holders(self, ns: str, hashes: Sequence[str]) -> tuple[L2Holding, ...]:
        """Who holds a leading run of `hashes` in L2, the longest first."""
        return self._get(ns).l2.leading(hashes)

    def register_peer(self, ns: str, holder: str, incarnation: str, rank: PeerRank) -> bool:
        """`holder`'s rank lends its L2 pages of `ns` to peers (L2Holders.register_peer);
        False: a retired incarnation, ignored."""
        return self._get(ns).l2.register_peer(holder, incarnation, rank)

    def best_peer(self, ns: str, hashes: Sequence[str], asker: str) -> PeerOffer:
        """The peer other than `asker` holding the longest leading run of `hashes` in L2."""
        return self._get(ns).l2.best_peer(ns, hashes, asker)

    def stats(self, ns: str) -> DirectoryStats:
        state = self._get(ns)
        self._expire()
        active = sum(1 for lease in self._leases.values() if lease.namespace == ns)
        return DirectoryStats(ns, len(state.published), len(state.pending),
                              state.info.spec.capacity_pages, active, epoch=state.info.epoch,
                              doomed_pages=self._deletes.count(ns), pins=len(state.pins),
                              pinned_pages=state.pins.pinned_pages(state.published),
                              expired_pins=state.pins.expired_total, l2_pages=len(state.l2),
                              l2_holders=state.l2.holders, peer_holders=state.l2.peers,
                              **vars(state.counters))

    # ---- pinned prefixes (page_pins) --------------------------------------------------------
    def pin(self, ns: str, pin_id: str, hashes: Sequence[str], ttl_s: float,
            max_fraction: float, tenant: str = "") -> int:
        """Pin the leading published pages of `hashes` for `ttl_s` past the last hit; pins
        may hold at most `max_fraction` of the quota. Returns the pages pinned; raises
        PinRoomError when they do not fit."""
        state = self._get(ns)
        now = self._expire()
        hits = self._leading(state, hashes)
        cap = state.info.spec.capacity_pages
        return state.pins.pin(pin_id, hashes[:hits], ttl_s, now,
                              int(max_fraction * cap) if cap else None,
                              f"the L3 namespace {ns}", tenant)

    def unpin(self, ns: str, pin_id: str) -> bool:
        state = self._get(ns)
        found = state.pins.unpin(pin_id)
        self._check_quota(state)  # pages it kept may be over the quota
        return found

    def refresh_pins(self, ns: str, pin_ids: Sequence[str]) -> int:
        """Hits elsewhere (an instance's L2) extend these pins; how many exist."""
        return self._get(ns).pins.refresh(pin_ids, self._expire())

    def pins(self, ns: str) -> list[L3PinListing]:
        state = self._get(ns)
        return state.pins.describe(self._expire(), state.published)

    # ---- the eviction pass (page_eviction runs it) -----------------------------------------
    @property
    def pass_due(self) -> bool:
        """Does a namespace need a pass (maybe over its quota), or a delete wait its turn?"""
        return self._deletes.queued or any(s.needs_pass for s in self._ns.values())

    def eviction_pass(self) -> int:
        """Lapse expired leases and unfinished pages, evict what each namespace's quota asks
        for: victims are unpublished now, their deletes queued. Returns pages queued."""
        before = self._deletes.added
        self._expire()
        for state in self._ns.values():
            if state.needs_pass:
                state.needs_pass = False
                self._enforce_quota(state)
        return self._deletes.added - before

    def take_deletes(self, max_pages: int = DELETE_BATCH_PAGES) -> list[DeleteBatch]:
        """Queued deletes, at most `max_pages` per namespace, to run outside the lock; give
        each batch's outcome back to `deletes_done`."""
        return self._deletes.take(max_pages, lambda ns: self._ns[ns].store)

    def deletes_done(self, outcomes: Sequence[DeleteOutcome]) -> None:
        """The deletes of these batches ran: their pages may be reported again; failures
        are counted (their objects stay until a rebuild lists them)."""
        for outcome in outcomes:
            batch = self._deletes.done(outcome.batch_id)
            if batch is None:
                continue  # from before close()
            state = self._ns.get(batch.namespace)
            if outcome.error and state is not None:
                state.counters.delete_failures += len(batch.hashes)
                log.warning("L3 namespace %s: deleting %d pages failed (%s); their objects "
                            "stay until the next rebuild", batch.namespace, len(batch.hashes),
                            outcome.error)

    def close(self) -> None:
        for state in self._ns.values():
            self._deletes.retire(state.store)
        self._deletes.clear()  # a store a delete still runs on is left to the process's exit
        self._ns.clear()
        self._leases.clear()
        self._expiry.clear()

    def __enter__(self) -> "PageDirectory":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ------------------------------------------------------------------------
    def _get(self, ns: str) -> NamespaceState:
        try:
            return self._ns[ns]
        except KeyError:
            raise UnknownNamespaceError(f"L3 namespace {ns!r} is not registered; register its "
                                        "NamespaceSpec first") from None

    def _leading(self, state: NamespaceState, hashes: Sequence[str]) -> int:
        hits = 0
        for h in hashes:
            if h not in state.published:
                break
            hits += 1
        self._touch(state, hashes[:hits])
        return hits

    @staticmethod
    def _touch(state: NamespaceState, hashes: Sequence[str]) -> None:
        # Why reversed: a chain's later pages are useless without its first ones, so the
        # first page ends up most recent and a prefix loses its tail first.
        for h in reversed(hashes):
            state.published.move_to_end(h)

    def _grant(self, state: NamespaceState, hashes: Sequence[str], ttl_s: float, now: float) -> str:
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) \
                or not 0 < ttl_s <= self.max_lease_s:
            raise CacheUsageError(f"a lease lasts more than 0 and at most {self.max_lease_s} s, "
                                  f"got ttl_s={ttl_s!r}; renew long prefetches with a new lease")
        if not hashes:
            return ""
        self._lease_seq += 1
        lease_id = f"{self._lease_prefix}-{self._lease_seq}"
        self._leases[lease_id] = _Lease(state.info.namespace, tuple(hashes), now + ttl_s)
        heapq.heappush(self._expiry, (now + ttl_s, lease_id))
        state.leased.update(hashes)
        state.counters.leases_granted += 1
        return lease_id

    def _unlease(self, lease: _Lease) -> None:
        state = self._ns.get(lease.namespace)
        if state is None:
            return
        state.leased.subtract(lease.hashes)
        for h in lease.hashes:
            if state.leased[h] <= 0:
                del state.leased[h]
        self._check_quota(state)  # pages it protected may be over the quota

    def _expire(self) -> float:
        """Lapse expired leases and pending pages whose writer never finished (their parts
        are queued for deletion); returns now."""
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self._ns[lease.namespace].counters.leases_expired += 1
                self._unlease(lease)
        for state in self._ns.values():
            stale = []
            for h, (_, first) in state.pending.items():  # oldest first
                if now - first < self.pending_ttl_s:
                    break
                stale.append(h)
            for h in stale:
                del state.pending[h]
            if state.pins.expire(now):
                self._check_quota(state)
            if stale:
                state.counters.expired_pending_pages += len(stale)
                self._deletes.add(state.info.namespace, stale)  # a gone writer's parts
        return now

    @staticmethod
    def _check_quota(state: NamespaceState) -> None:
        """Mark the namespace for the next pass when it is over its quota (cheap: no delete)."""
        cap = state.info.spec.capacity_pages
        if cap and len(state.published) > cap:
            state.needs_pass = True

    def _enforce_quota(self, state: NamespaceState) -> None:
        """Evict least recently used unleased pages until the quota holds (their deletes are
        queued). A leased page is never evicted: when only leased pages are older, the
        newest pages go instead."""
        cap = state.info.spec.capacity_pages
        excess = len(state.published) - cap
        if not cap or excess <= 0:
            return
        victims = []
        for h in state.published:
            if not state.leased.get(h) and not state.pins.holds(h):
                victims.append(h)
                if len(victims) == excess:
                    break
        for h in victims:  # unpublished first: nobody is told to read a page being deleted
            del state.published[h]
        state.counters.evicted_pages += len(victims)
        self._deletes.add(state.info.namespace, victims)
