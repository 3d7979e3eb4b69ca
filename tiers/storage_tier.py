"""The L3 side of one rank's cache: query, prefetch (L3->L2) under a policy, backup (L2->L3).

Prefetch: after the local match, the pages past the local hit are looked up in L3; if enough
are there (the prefetch threshold), L2 pages are allocated for exactly that many (capped by
the prefetch capacity) and fetched in batches. When the policy says the request may go, the
pages that landed are inserted into the tree as L2-only nodes, the rest freed. Backup: once an
L1->L2 copy lands, the node's L2 pages are written to L3 while protected from L2 eviction.

With a page directory (`directory`, the L3 namespace's: docs/architecture.md invariant 3), a
page is an L3 hit only when the directory has published it (every KV head of it stored, by
whichever ranks): the prefetch asks the directory, under a lease held until the prefetch ends,
instead of the backend; and each rank reports the pages its backups fully wrote, with the KV
heads it owns. A directory call that fails makes that request an L3 miss (counted in
`directory_errors` and, for lookups, `directory_miss_lookups`), never an error.

After a failed call the directory is "away": what this rank stores meanwhile waits,
unreported. By default the next poll reports it again (an in-process directory cannot lose the
namespace). A rank under a namespace actor sets `confirm_return`: the actor may come back
without the namespace, or with other storage behind it, so until the rank has seen that the
namespace is the one it attached (`directory_back`) the directory is neither asked (lookups
are misses) nor told anything, and the pages stored meanwhile wait, or are dropped with the
storage (`storage_emptied`, a re-attach): a page is never published on the word of a writer
whose storage the directory may no longer have, nor read from storage the rank has not
checked is the namespace's.
"""
from __future__ import annotations

import logging
import time
from typing import NamedTuple, Sequence

from kvtier.backends.base import StorageBackend
from kvtier.config import HiCacheConfig
from kvtier.errors import ConfigError
from kvtier.keys import KeyNamespace
from kvtier.policies import HostMode, PrefetchPolicy
from kvtier.tiers.allocator import PageAllocator
from kvtier.tiers.radix_tree import HiRadixTree
from kvtier.tiers.sliding_l3 import SlidingL3
from kvtier.tiers.peer_fetch import PeerFetch, PeerPages, PeerWorker
from kvtier.tiers.storage_worker import OpState, StorageOp, StorageWorker
from kvtier.tiers.storage_types import (PageDirectoryClient, PrefetchSource, PrefetchTicket,
                                        StorageCounters, node_tokens)
from kvtier.tiers.tree_node import NOT_STORED, TreeNode

log = logging.getLogger(__name__)


class _PeerChoice(NamedTuple):
    pages: int  # the peer's leading run past the local hit
    fetch: PeerFetch


SETTLE_WAIT_S = 0.05  # how long ending a prefetch waits for a backend call in flight
BATCH_SLACK = 4.0  # best_effort: a batch in flight is overdue after this times its usual time
DEFAULT_READ_S_PER_PAGE = 0.01  # the usual time before this rank has measured a read
MAX_UNREPORTED_PAGES = 1 << 16  # kept for a retried report; older ones wait for a rebuild
DIRECTORY_LEASE_S = 60.0  # a lease covering one prefetch; released when the prefetch ends


class StorageTier:
    """L3 for one rank: owns the storage worker, borrows the tree and the L2 allocator."""

    def __init__(self, backend: StorageBackend | None, tree: HiRadixTree,
                 host_allocator: PageAllocator,
                 config: HiCacheConfig, namespace: KeyNamespace, alloc_host,
                 directory: PageDirectoryClient | None = None,
                 lease_ttl_s: float = DIRECTORY_LEASE_S, sliding: SlidingL3 | None = None
                 ) -> None:
        """`sliding`: a hybrid model's sliding-window pool, backed up and fetched along.
        `backend` None: the namespace's directory without its storage (peers only: nothing
        is backed up or read from L3)."""
        self.backend = backend
        self.tree = tree
        self.host_allocator = host_allocator
        self.config = config
        self.namespace = namespace
        self.page_size = config.page_size
        self._alloc_host = alloc_host  # callable(n) -> pages | None, evicting L2 as needed
        self.worker = StorageWorker(backend, config.storage_batch_pages)
        self.counters = StorageCounters()
        self._prefetch_capacity = max(1, int(config.prefetch_capacity_ratio * host_allocator.num_pages))
        self._inflight_pages = 0
        self._orphans: list[tuple[StorageOp, list[int]]] = []  # see _free_when_settled
        self._tickets: dict[int, PrefetchTicket] = {}  # op id -> open ticket: the one registry
        self.directory = directory  # None: the backend's exists() says what L3 holds
        self._unreported: list[str] = []  # stored pages not reported yet (a failure, away)
        self.directory_away = False  # a directory call failed since it last answered
        self.confirm_return = False  # away: hold reports until `directory_back` (docstring)
        # storage_only: the cache gives back L2 copies once stored (take_stored)
        self._keep_stored = config.host_mode is HostMode.STORAGE_ONLY
        self._stored_nodes: list[TreeNode] = []
        self.lease_ttl_s = lease_ttl_s
        self.sliding = sliding
        self.peer_worker: PeerWorker | None = None  # reads peers' L2 (attach_peers)
        self.holder = ""  # this instance's name as an L2 holder

    # ---- prefetch ------------------------------------------------------------------------
    def page_keys(self, tokens: Sequence[int], salt: str = "") -> list[str]:
        return self.namespace.page_hashes(tokens, self.page_size, salt)

    def prefetch(self, tokens: Sequence[int], local_pages: int, anchor: TreeNode,
                 retry: bool = False) -> PrefetchTicket | None:
        """Start fetching what L3 holds past the `local_pages` already in L1/L2, or None.

        `retry`: the request asked when it arrived and found too little; its misses were
        counted then, so a retry counts only in `retried_lookups` and, when it starts a
        fetch, in `retried_hit_tokens` and the hit counters."""
        p, threshold = self.page_size, self.config.prefetch_threshold_tokens
        tally = StorageCounters() if retry else self.counters  # a retry's misses: not again
        tokens = tuple(tokens)
        keys = self.page_keys(tokens, anchor.salt)[local_pages:]
        if not keys:
            return None
        tally.queried_tokens += len(keys) * p
        if len(keys) * p < threshold:
            tally.unfulfilled_below_threshold_tokens += len(keys) * p
            return None
        if retry:
            self.counters.retried_lookups += 1
        if self.backend is None:  # no storage: only peers
            hit, lease_id = 0, ""
        elif self.directory is None:
            hit, lease_id = self._backend_lookup(keys), ""
        else:
            hit, lease_id = self._directory_lookup(keys)
        fetch = self._peer_fetch(keys, hit, local_pages)
        if fetch is None:
            tally.storage_hit_tokens += hit * p
        else:  # a peer holds more than L3 published: read from it, L3's lease goes back
            self._release(lease_id)
            hit, lease_id = fetch.pages, ""
            tally.peer_hit_tokens += hit * p
        if hit == 0:
            self._release(lease_id)
            return None
        if hit * p < threshold:
            tally.unfulfilled_below_threshold_tokens += hit * p
            self._release(lease_id)
            return None
        room = self._prefetch_capacity - self._inflight_pages
        take = min(hit, room)
        if self.sliding is not None:  # a hit must end where L3 has its window's sliding KV
            present = self.sliding.present(keys[:hit])
            usable = self.sliding.usable_end(present, take)
            tally.unfulfilled_sliding_window_tokens += (take - usable) * p
            take = usable
        self.tree.protect_host(anchor)  # first: making room must not evict the anchor's path
        host_pages = self._alloc_host(take) if take * p >= threshold else None
        if host_pages is None:
            self.tree.release_host(anchor)
            tally.unfulfilled_host_capacity_tokens += hit * p
            self._release(lease_id)
            return None
        if retry:
            self.counters.retried_hit_tokens += take * p
            if fetch is None:
                self.counters.storage_hit_tokens += hit * p
            else:
                self.counters.peer_hit_tokens += hit * p
        self.counters.unfulfilled_host_capacity_tokens += (hit - take) * p
        self._inflight_pages += take
        if fetch is None:
            op, source = self.worker.prefetch(keys[:take], host_pages), PrefetchSource.STORAGE
        else:
            assert self.peer_worker is not None
            op = self.peer_worker.prefetch(keys[:take], host_pages, fetch.fetch)
            source = PrefetchSource.PEER
        timeout = self.config.prefetch_timeout_s(take * p)
        ticket = PrefetchTicket(tokens, local_pages, hit, op, anchor, timeout, lease_id=lease_id,
                                source=source)
        if self.sliding is not None:
            ticket.sliding = self.sliding.fetch(keys[:take], host_pages)
        self._tickets[op.id] = ticket
        return ticket

    def _peer_fetch(self, keys: list[str], hit: int, first_page: int) -> _PeerChoice | None:
        """A peer to read `keys` from when one holds a longer leading run of them than L3's
        `hit` (None: L3, or nothing). Any failure of the directory is a peer miss."""
        if self.peer_worker is None or hit >= len(keys) or self.directory is None or self._held:
            return None
        try:
            offer = self.directory.best_peer(self.namespace.name, keys, self.holder)
        except Exception as exc:  # noqa: BLE001 - a failed peer lookup is a miss
            self.counters.peer_lookup_errors += 1
            self.directory_failed("a peer lookup", exc)
            return None
        pages = min(int(offer.pages), len(keys))
        if offer.contact is None or pages <= hit:
            return None
        return _PeerChoice(pages, PeerFetch(offer.contact, first_page))

    def attach_peers(self, reader: PeerPages, holder: str) -> None:
        """Read what peers hold in L2 (and L3 lacks) through `reader`; `holder` is this
        instance's name in the directory's L2 listing (never offered to itself)."""
        if self.sliding is not None:
            raise ConfigError("peer-to-peer L2 does not carry a hybrid model's sliding-window "
                              "KV; turn peers off for this model")
        self.detach_peers()
        self.peer_worker = PeerWorker(reader, self.config.storage_batch_pages)
        self.holder = holder

    def detach_peers(self) -> None:
        """Stop reading from peers: open peer prefetches are aborted (nothing leaks)."""
        if self.peer_worker is None:
            return
        for ticket in [t for t in self._tickets.values() if t.source is PrefetchSource.PEER]:
            self.abort(ticket)
        self.peer_worker.close()
        self.peer_worker = None

    def _worker(self, ticket: PrefetchTicket) -> StorageWorker:
        """The worker running `ticket`'s op."""
        if ticket.source is PrefetchSource.PEER and self.peer_worker is not None:
            return self.peer_worker
        return self.worker

    def _backend_lookup(self, keys: list[str]) -> int:
        """Leading pages the backend holds; 0 (a miss, counted) when asking it fails."""
        try:
            return self.backend.exists(keys).usable_pages
        except Exception as exc:  # noqa: BLE001 - a failing L3 is a miss, never a lost request
            self.counters.lookup_errors += 1
            log.warning("L3 lookup failed (%s: %s); treating it as a miss",
                        type(exc).__name__, exc)
            return 0

    def _directory_lookup(self, keys: list[str]) -> tuple[int, str]:
        """(published leading pages, lease id) from the directory; (0, "") when it fails
        or is away under `confirm_return` (it is not asked then)."""
        assert self.directory is not None
        if self._held:
            self.counters.directory_miss_lookups += 1
            return 0, ""
        try:
            res = self.directory.lookup(self.namespace.name, keys, self.lease_ttl_s)
            hit, lease_id = int(res.hit_pages), str(res.lease_id or "")
        except Exception as exc:  # noqa: BLE001 - any directory failure is an L3 miss
            self.counters.directory_miss_lookups += 1
            self.directory_failed("a lookup", exc)
            return 0, ""
        if not 0 <= hit <= len(keys):
            self.counters.directory_miss_lookups += 1
            self.directory_failed("a lookup", ValueError(f"{hit} hit pages for {len(keys)} "
                                                         "asked"))
            self._release(lease_id)
            return 0, ""
        if not self.confirm_return:
            self.directory_away = False  # it answers again (module docstring)
        return hit, lease_id

    def directory_failed(self, call: str, exc: BaseException) -> None:
        """Count a failed directory call (the rank's own, too: its namespace checks) and mark
        the directory away (module docstring). The first failure of an outage is a warning,
        the rest debug: an outage is one message, not one per request."""
        self.counters.directory_errors += 1
        level = logging.DEBUG if self.directory_away else logging.WARNING
        self.directory_away = True
        log.log(level, "L3 page directory: %s failed (%s: %s); L3 misses and stored pages "
                "unpublished until it answers", call, type(exc).__name__, exc)

    @property
    def _held(self) -> bool:
        """Away under `confirm_return`: the directory is not asked nor told anything (misses,
        reports wait) until the owner has seen the namespace back (`directory_back`)."""
        return self.directory_away and self.confirm_return

    def directory_back(self) -> None:
        """The owner saw the namespace as it attached it (`confirm_return`): report what
        waited."""
        self.directory_away = False
        if self._unreported:
            self._report([])

    def forget_reports(self) -> None:
        """Drop the pages waiting to be reported: the storage they were written to is gone or
        was emptied (a purge, a new master)."""
        if self._unreported:
            log.info("dropping %d stored L3 pages never reported: their storage changed",
                     len(self._unreported))
        self._unreported = []

    def _release(self, lease_id: str) -> None:
        if not lease_id or self.directory is None:
            return
        try:
            self.directory.release(lease_id)
        except Exception as exc:  # noqa: BLE001 - the lease lapses at its TTL anyway
            self.directory_failed(f"releasing lease {lease_id}", exc)

    def ready(self, ticket: PrefetchTicket, now_s: float | None = None,
              at_admission: bool = True) -> bool:
        """May the request stop waiting for its prefetch (per the prefetch policy)?

        best_effort ends when admission reaches the request (`at_admission`; a caller without
        a scheduler always is), with what landed by then plus the batch being read at that
        moment (the first batch, when the worker has not taken it up yet: admission may come
        within a millisecond of the submission): reaching it stops the prefetch after that
        batch, and the batch is waited for, without blocking (the scheduler steps on), until
        it lands or is overdue. Why wait for it: a read already under way lands in a
        fraction of what recomputing its pages costs (the premise of prefetching at all),
        while ending it at once would make the request recompute them next to a read it can
        no longer use, which then only competes for the CPU."""
        op = ticket.op
        if op.state.finished:
            return True
        now = time.monotonic() if now_s is None else now_s
        policy = self.config.prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            if not at_admission:
                return False
            self._worker(ticket).stop_after_batch(op)  # idempotent
            return op.state.finished or self._overdue(ticket, now)
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return False
        return now - op.submitted_s >= ticket.timeout_s

    def _overdue(self, ticket: PrefetchTicket, now_s: float) -> bool:
        """The batch being read took BATCH_SLACK times what reads here take (at least
        SETTLE_WAIT_S, at most the ticket's timeout): a slow or hung backend, go on without
        it (`finish` then leaves its pages to the worker, `_free_when_settled`). Timed from
        the batch's start (or, for a first batch still queued, from the submission), not
        the prefetch's: a request may be reached long after."""
        op, worker = ticket.op, self._worker(ticket)
        if op.state is OpState.RUNNING:
            started, pages = op.batch_started_s, op.batch_pages
        elif op.next_page == 0:  # its first batch waits for the worker's turn
            started, pages = op.submitted_s, min(op.num_pages, worker.batch_pages)
        else:  # between batches: stop_after_batch ends it at once
            return False
        per_page = worker.read_s_per_page or DEFAULT_READ_S_PER_PAGE
        allowed_s = min(ticket.timeout_s, max(SETTLE_WAIT_S, BATCH_SLACK * pages * per_page))
        return now_s - started >= allowed_s

    def wait(self, ticket: PrefetchTicket, poll_s: float = 0.001) -> None:
        """Block until `ready` (a helper for callers without a scheduler loop)."""
        while not self.ready(ticket):
            ticket.op._settled.wait(poll_s)

    def finish(self, ticket: PrefetchTicket, max_pages: int | None = None) -> int:
        """Stop the prefetch, insert what landed (at most `max_pages` pages: what every TP
        rank landed) as L2-only nodes; returns tokens inserted."""
        settled = self._end(ticket)
        op, from_l3 = ticket.op, ticket.source is PrefetchSource.STORAGE
        if from_l3 and settled and op.state is OpState.DONE and op.missing_keys:
            self._report_missing(op.missing_keys)  # a peer's misses say nothing of L3
        done = op.done_pages  # these pages are complete; a hung batch only touches later ones
        if max_pages is not None:
            done = max(0, min(done, max_pages))
        end_page = ticket.start_page + done
        landed = op.host_pages[:done]
        res = self.tree.insert_host(ticket.tokens[: end_page * self.page_size], landed,
                                    skip_pages=ticket.start_page, salt=ticket.anchor.salt)
        self.host_allocator.free(list(res.unused_pages))
        self._free_when_settled(op, op.host_pages[done:], settled)
        self.tree.release_host(ticket.anchor)
        if done and from_l3:  # a peer's pages are not in L3: they are backed up as any
            self.tree.l3.mark_stored(res.last_node, ticket.start_page)
        # pages of the prefix the tree now holds (any tier) past the local hit
        usable = max(0, min(res.prefix_pages + res.new_pages, end_page) - ticket.start_page)
        self.counters.prefetched_tokens += usable * self.page_size
        if not from_l3:
            self.counters.peer_prefetched_tokens += usable * self.page_size
        self.counters.unfulfilled_storage_transfer_tokens += (op.num_pages - done) * self.page_size
        self.counters.prefetch_wait_s += (op.finished_s or time.monotonic()) - op.submitted_s
        return usable * self.page_size

    def _report_missing(self, keys: list[str]) -> None:
        """The directory published pages the backend read says are missing or corrupt
        (deleted behind the directory's back): tell it, so it unpublishes them. Only when
        the read answered (not a cancelled, failed or hung op: those say nothing of the
        page). A failed report is a missed chance, counted, never an error."""
        if self.directory is None or self._held:  # a later reader that misses reports
            return
        try:
            self.directory.report_missing(self.namespace.name, keys)
        except Exception as exc:  # noqa: BLE001 - the next reader that misses reports again
            self.directory_failed(f"reporting {len(keys)} missing pages", exc)

    def await_prefetch(self, timeout_s: float) -> bool:
        """Block (the GIL released) until some open prefetch ends or `timeout_s` passed;
        whether one did. For a caller whose step could do nothing but wait for one."""
        for ticket in list(self._tickets.values()):
            if not ticket.op.state.finished:
                return ticket.op.wait(timeout_s)
        return bool(self._tickets)  # every open one ended already

    @property
    def open_tickets(self) -> int:
        """Prefetches started and not yet finished or aborted."""
        return len(self._tickets)

    def abort_all(self) -> None:
        """Abort every open prefetch (detach, shutdown): nothing inserted, nothing leaks."""
        for ticket in list(self._tickets.values()):
            self.abort(ticket)

    def abort(self, ticket: PrefetchTicket) -> None:
        """Drop a prefetch (request aborted): nothing is inserted, every page is freed."""
        settled = self._end(ticket)
        self._free_when_settled(ticket.op, ticket.op.host_pages, settled)
        self.tree.release_host(ticket.anchor)

    def _end(self, ticket: PrefetchTicket) -> bool:
        """Cancel the prefetch; True when the worker no longer touches its host pages.

        A backend call that hangs must not hang the scheduler (the reference's users saw
        exactly that): after a short wait (none for a batch already overdue: it was waited
        for) the request goes on without the pages in flight, which stay allocated until the
        worker lets go of them (`_free_orphans`)."""
        if ticket.finished:
            raise RuntimeError("a prefetch ticket was finished twice")
        ticket.finished = True
        worker = self._worker(ticket)
        worker.cancel(ticket.op)
        overdue = self._overdue(ticket, time.monotonic())
        settled = worker.settle(ticket.op, 0.0 if overdue else SETTLE_WAIT_S)
        self._inflight_pages -= ticket.op.num_pages
        self._tickets.pop(ticket.op.id, None)
        if self.sliding is not None:  # before the pages are inserted or freed
            self.sliding.settle(ticket.sliding)
        self._release(ticket.lease_id)  # the pages are read: eviction may take them again
        return settled

    def _free_when_settled(self, op: StorageOp, pages: list[int], settled: bool) -> None:
        if settled:
            self.host_allocator.free(pages)
        elif pages:
            log.warning("an L3 read of %d pages is still running after its request moved on "
                        "(a slow or hung backend); its L2 pages are freed when it ends",
                        len(pages))
            self._orphans.append((op, pages))

    def _free_orphans(self) -> None:
        """Free the L2 pages of abandoned prefetches whose worker call has returned."""
        still = []
        for op, pages in self._orphans:
            if op.settled:
                self.host_allocator.free(pages)
            else:
                still.append((op, pages))
        self._orphans = still
        self.counters.quarantined_pages = sum(len(p) for op, p in still if op.quarantined)

    @property
    def orphaned_pages(self) -> int:
        """L2 pages held by abandoned prefetches whose backend call has not returned."""
        return sum(len(pages) for _, pages in self._orphans)

    # ---- backup --------------------------------------------------------------------------
    def backup(self, node: TreeNode) -> StorageOp | None:
        """Write the L2 pages of `node` and of its ancestors not yet in L3 (one op).

        The path is protected from L2 eviction until the op ends. Nodes remember the op, and
        a split copies that, so a run split while being written is still marked when done.
        """
        if self.backend is None:
            return None
        path = list(node.path_to_root())[::-1]  # root side first
        todo = [n for n in path if n.host_value is not None and n.storage_op == NOT_STORED]
        if not todo:
            return None
        tokens = node_tokens(node)
        all_keys = self.page_keys(tokens, node.salt)
        keys, pages, start = [], [], 0
        for n in path:
            count = len(n.key) // self.page_size
            if n in todo:
                keys += all_keys[start : start + count]
                pages += n.host_value
            start += count
        self.tree.protect_host(node)
        op = self.worker.backup(keys, pages, node)
        self.tree.l3.mark_storing(todo, op.id)
        if self.sliding is not None:
            self.sliding.backup(keys, pages, node)
        return op

    def poll(self) -> int:
        """Release nodes whose backups ended and record what reached L3."""
        if self._orphans:
            self._free_orphans()
        if self.sliding is not None:
            self.sliding.poll()
        ended = self.worker.finished_backups()
        stored: list[str] = []
        for op in ended:
            stored += op.keys[: op.done_pages]  # leading pages fully written by this rank
            node = op.payload
            self.tree.l3.end_storing(node, op.id, op.done_pages == op.num_pages)
            self.tree.release_host(node)
            if self._keep_stored and op.done_pages == op.num_pages:
                self._stored_nodes.append(node)
            self.counters.backed_up_tokens += op.done_pages * self.page_size
            self.counters.backup_failed_tokens += (op.num_pages - op.done_pages) * self.page_size
        if (stored or self._unreported) and self.directory is not None:
            self._report(stored)
        return len(ended)

    def take_stored(self) -> list[TreeNode]:
        """Nodes whose backups wrote every page since the last call (storage_only mode)."""
        nodes, self._stored_nodes = self._stored_nodes, []
        return nodes

    def _report(self, keys: list[str]) -> None:
        """Tell the directory this rank's heads of `keys` (and of any earlier report that
        waits) are written; it publishes a page once every KV head is. On failure, and while
        the directory is away under `confirm_return`, the pages wait, unpublished (readers see
        a miss), for a later report (module docstring); a restarted directory also finds them
        when it rebuilds from the backend."""
        assert self.directory is not None
        keys = self._unreported + keys
        self._unreported = []
        if self._held:
            self._unreported = keys[-MAX_UNREPORTED_PAGES:]
            return
        try:
            self.directory.report_stored(self.namespace.name, keys, self.backend.target.heads)
        except Exception as exc:  # noqa: BLE001 - an unpublished page is only a missed hit
            self._unreported = keys[-MAX_UNREPORTED_PAGES:]
            self.directory_failed(f"reporting {len(keys)} stored pages", exc)
            return
        self.directory_away = False
        self.counters.directory_reported_pages += len(keys)

    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait until queued backups have ended (tests, detach, shutdown)."""
        deadline = time.monotonic() + timeout_s
        workers = [self.worker] + ([self.sliding.worker] if self.sliding is not None else [])
        while any(w.pending() for w in workers) and time.monotonic() < deadline:
            time.sleep(0.002)
        self.poll()

    def close(self, drain: bool = True) -> None:
        """Finish (or cancel) queued work, release every protection, close the backend."""
        self.abort_all()
        self.detach_peers()
        if drain:
            self.drain()
        self.worker.close()
        if self.sliding is not None:
            self.sliding.close()
        self.poll()
        if self.backend is not None:
            self.backend.close()
