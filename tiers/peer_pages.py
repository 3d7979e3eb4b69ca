"""Peer-to-peer L2, the data plane: one instance's TP rank reads pages of a prompt prefix that
another instance holds in its L2 straight into its own L2 pages, with one-sided READs.

Why a read and not the holder pushing: the reader owns the pages the bytes land in, so a
holder that dies or hangs never writes into pages the reader has meanwhile given to someone
else (TransportEndpoint.read). Why L2 and not L1: L2 in `page_head` keeps each KV head's K (or
V) of a page, over every layer, as one contiguous object, so ranks of different TP sizes move
whole head objects (a holder at TP 1 serves a reader at TP 3 one third of its heads each, a
holder at TP 3 serves a reader at TP 1 one head each); L1 interleaves heads token by token.

The protocol, per reader rank and prompt; nothing on the holder takes part:
  look up  the reader reads the table of every holder rank that holds some of its heads
           (tiers/peer_table.py: a row per L2 page, its chain key and one xxh3_64 per head,
           which the holder keeps in memory its endpoint registered) and finds where the
           leading pages of the prefix lie: a `PeerLend` per holder rank
  read     one transport read per holder rank: the head objects of the pages every holder
           rank lists land in the same heads of the reader's pages; a large read is split
           among the reader's endpoints (`lanes`), each share on a thread of its own
  verify   each share's thread sums what it landed, and the reader keeps the leading pages
           whose every head matched, and leaves their sums to the pool's owner, which lists
           the pages for its own peers with them (PeerPool.verified)

Nothing holds the listed pages on the holder between the look-up and the read: a holder that
evicts one and reuses its page meanwhile is caught by the sums (the read then ends before
that page), and a holder must not wait on a peer to manage its own L2. A holder busy in a
long step is read as fast as an idle one (over NIXL's shared-memory path even a stopped one).
"""
from __future__ import annotations

import enum
import logging
import time
from concurrent import futures
from typing import Callable, NamedTuple, Protocol, Sequence

import numpy as np

from kvtier.backends.transport_base import TransportEndpoint, TransportTimeout
from kvtier.errors import CacheUsageError, ClosedError, ConfigError, KvtierError
from kvtier.kv_spec import HeadRange
from kvtier.messages import PeerContact, PeerLend, PeerRank
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.page_exchange import PoolMemory, head_regions
from kvtier.tiers.peer_table import PeerTable, lookup, row_dtype

log = logging.getLogger(__name__)

# lookup(holder rank, chain keys of the pages wanted, global heads): where that rank's L2
# holds the leading run of them, as a PeerLend (PeerReader.lookup reads the rank's table)
LookupFn = Callable[[PeerRank, Sequence[str], "tuple[int, ...]"], PeerLend]
MAX_WARNED = 1024  # (holder rank, reason) pairs warned about before the memory starts over
RAW_READS = 3  # raw_read's tries, the fastest counted
# A read of at least twice this many bytes is split among the reader's endpoints (`lanes`):
# each moves its share and sums it on a thread of its own (docs/benchmarks.md, "Peer reads
# in lanes"); one UCX worker copies on one core.
LANE_BYTES = 4 << 20
# Table copies a look-up's read timed out into, replaced or closed since: the transport may
# still write them (TransportEndpoint.read), so they stay allocated until exit (registered
# until their endpoint closes).
_LATE: list[np.ndarray] = []


class PeerReadOutcome(str, enum.Enum):
    """Why a peer read brought fewer pages than asked (ALL: it did not)."""

    ALL = "all"  # every page asked arrived whole and verified
    HOLDER_MISSING_PAGES = "holder_missing_pages"  # a holder rank lists fewer pages: it
    # lacks the rest in L2 (evicted, never held, or their L1->L2 copy has not landed)
    SUM_MISMATCH = "sum_mismatch"  # a page's bytes changed on the holder after the look-up
    NO_HEADS = "no_heads"  # the holder's ranks do not hold every KV head this rank needs
    LOOKUP_FAILED = "lookup_failed"  # a holder rank's table could not be read (its endpoint
    # gone) or does not fit its contact
    TRANSPORT_FAILED = "transport_failed"  # a read failed (the holder's endpoint gone, ...)
    TRANSPORT_TIMEOUT = "transport_timeout"  # a read did not finish in time, and the
    # transport may still write the reader's pages until its own timeout ends it (Mooncake:
    # backends/transport_mooncake.py): give them to nothing else before then


class PeerRead(NamedTuple):
    """What one `PeerReader.read` brought: its first `pages` pool pages hold the prompt's
    pages, whole and verified; what the others hold is undefined."""

    pages: int
    bytes: int  # moved by the transport, the pages that did not verify included
    seconds: float  # the whole call: look-ups, reads, checks
    reason: PeerReadOutcome
    lookup_s: float = 0.0  # of `seconds`: reading the holder ranks' tables
    transfer_s: float = 0.0  # the transport reads
    verify_s: float = 0.0  # summing what landed

    @property
    def transport_may_write(self) -> bool:
        """A read timed out: its transport may still write the host pages for a while, so
        they must not be reused before then (tiers/peer_fetch.py quarantines them)."""
        return self.reason is PeerReadOutcome.TRANSPORT_TIMEOUT


class RawPeerRead(NamedTuple):
    """The transport alone on the same head objects (`PeerReader.raw_read`)."""

    pages: int
    bytes: int
    seconds: float  # in the transport's read calls


class PeerReadCounters(NamedTuple):
    """Monotonic totals of one reader's `read` calls."""

    reads: int
    pages: int  # verified pages delivered
    bytes: int
    failures: int  # calls that brought nothing because a holder or the transport failed
    mismatches: int  # calls cut short by a page whose bytes did not match their sum
    seconds: float = 0.0  # in `read`, all of it
    lookup_s: float = 0.0  # of which looking up, reading, verifying (PeerRead)
    transfer_s: float = 0.0
    verify_s: float = 0.0


class _Source(NamedTuple):
    """One holder rank a read takes heads from: where it lists the pages, and those heads as
    this rank's pool (`ours`) and the holder's (`theirs`) number them, in the same order."""

    rank: PeerRank
    lend: PeerLend
    ours: list[int]
    theirs: list[int]


FAILURES = frozenset({PeerReadOutcome.NO_HEADS, PeerReadOutcome.LOOKUP_FAILED,
                      PeerReadOutcome.TRANSPORT_FAILED, PeerReadOutcome.TRANSPORT_TIMEOUT})


class PeerPool(Protocol):
    """A rank's L2 as peer reads address it: whole KV-head objects of its pages. The layout
    is the pool's own, and a holder's and its reader's pools have the same one (they are of
    one key namespace, whose fingerprint names the layout)."""

    def memory(self) -> PoolMemory:
        """The pool's buffer now (registered before every use: it may move)."""
        ...

    def head_regions(self, base_addr: int, pool_pages: int, pool_heads: int,
                     pages: Sequence[int], heads: Sequence[int]) -> np.ndarray:
        """(addr, nbytes) rows of the head objects (`heads`: the pool's own indices) of
        `pages` in a pool of this layout at `base_addr`: page by page, then head, then part
        (K, V), in whatever runs the layout keeps them."""
        ...

    def head_sums(self, pages: Sequence[int], heads: Sequence[int]) -> tuple[int, ...]:
        """xxh3_64 over each (page, head)'s K then V object, page by page then head."""
        ...

    def verified(self, pages: Sequence[int], sums: Sequence[int]) -> None:
        """A read's check found `pages` holding bytes whose sums are `sums` (page by page,
        then every head of the pool in order): the owner may list them with these
        (tiers/peer_table.VerifiedSums) instead of summing them again."""
        ...


class CachePool:
    """A `HierarchicalCache`'s L2, held in `page_head` from now on, as a `PeerPool`."""

    def __init__(self, cache: HierarchicalCache, heads: HeadRange) -> None:
        """Raises unless `cache` can lend or receive head objects of `heads` (global KV
        heads, this rank's)."""
        if not cache.hierarchical:
            raise ConfigError("peer L2 moves pages between L2 pools, and this cache has none: "
                              "enable the hierarchical cache")
        if cache.spec.sliding is not None:
            raise ConfigError("peer L2 moves full-attention KV only; a hybrid model's "
                              "sliding-window KV lives in a sidecar no peer read moves")
        if heads.count != cache.spec.num_kv_heads:
            raise ConfigError(f"KV heads [{heads.start}, {heads.stop}) are {heads.count} "
                              f"heads, but this rank's pool holds {cache.spec.num_kv_heads}: "
                              "pass the rank's own HeadRange.of_rank(total, rank, size)")
        cache.use_head_major_host()
        self.cache = cache

    def memory(self) -> PoolMemory:
        return self.cache.exchange.l2  # a relayout moves it

    def head_regions(self, base_addr: int, pool_pages: int, pool_heads: int,
                     pages: Sequence[int], heads: Sequence[int]) -> np.ndarray:
        return head_regions(self.cache.spec, pool_heads, base_addr, pool_pages, pages, heads)

    def head_sums(self, pages: Sequence[int], heads: Sequence[int]) -> tuple[int, ...]:
        return self.cache.exchange.l2_head_sums(pages, heads)

    def verified(self, pages: Sequence[int], sums: Sequence[int]) -> None:
        self.cache.peer_sums.put(pages, sums, self.cache.spec.num_kv_heads)


def _register(pool: PeerPool, endpoint: TransportEndpoint) -> PoolMemory:
    """The pool as it is now, registered on `endpoint` (idempotent)."""
    memory = pool.memory()
    endpoint.register(memory.addr, memory.nbytes, memory.device)
    return memory


class PeerLender:
    """The holder side of one TP rank: keeps a table of its L2 pages (tiers/peer_table.py)
    in memory registered on its endpoint, beside L2 itself, for peers to look up and read
    with one-sided reads; the pool's owner keeps the table current (`publish` is handed it:
    `HierarchicalCache.publish_l2`, the vLLM connector's worker). It answers nothing
    itself."""

    def __init__(self, pool: PeerPool, endpoint: TransportEndpoint, heads: HeadRange,
                 publish: Callable[[PeerTable | None], None]) -> None:
        """`heads`: the KV heads (global indices) this rank's pool holds; `publish`: the
        owner's, given the table now and None at `close`."""
        self.pool, self.endpoint, self.heads = pool, endpoint, heads
        self.l2 = _register(pool, endpoint)
        self.table = PeerTable(self.l2.num_pages, heads.count)
        endpoint.register(self.table.addr, self.table.nbytes, "cpu")
        self._publish = publish
        publish(self.table)

    def contact(self, rank: int, size: int, actor: str = "", ray_namespace: str = ""
                ) -> PeerRank:
        """How peers reach this rank: its heads, its endpoint's address (taken after L2
        and the table were registered), where L2 and the table lie."""
        return PeerRank(rank, size, self.heads.start, self.heads.stop, actor, ray_namespace,
                        self.endpoint.address(), self.l2.addr, self.l2.num_pages,
                        self.table.addr)

    def close(self) -> None:
        """Stop keeping the table (the endpoint that registered it closes after this)."""
        self._publish(None)


class PeerReader:
    """The reader side of one TP rank: reads a prefix's pages from a peer instance's L2 into
    pages of its own pool, verified. `read` touches only the pool pages it is given (and
    reads where the pool lies), never the pool owner's index: like an L3 read into the pages
    a prefetch holds, it may run on a worker thread while the owner serves; one call at a
    time."""

    def __init__(self, pool: PeerPool, endpoint: TransportEndpoint, heads: HeadRange,
                 timeout_s: float, lookup_fn: LookupFn | None = None,
                 lanes: Sequence[TransportEndpoint] = ()) -> None:
        """`heads`: the KV heads (global indices) this rank's pool holds. `timeout_s`: each
        transport read's limit. `lookup_fn`: where a holder rank holds pages (default:
        `lookup`, which reads its table; what raises there is a failed look-up, never this
        reader's). `lanes`: more endpoints of the same transport (the caller's to close),
        each reading a share of a large read beside `endpoint` (LANE_BYTES)."""
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds: {timeout_s}")
        self.pool, self.endpoint, self.heads = pool, endpoint, heads
        self.timeout_s = timeout_s
        self.lookup_fn: LookupFn = lookup_fn or self.lookup
        _register(pool, endpoint)
        self._totals = PeerReadCounters(0, 0, 0, 0, 0)
        self._warned: set[tuple[str, PeerReadOutcome]] = set()
        # holder rank index -> its table's copy, registered on `endpoint` (deregistered
        # when replaced by a larger one and at close); those a read timed out into: `_late`
        self._scratch: dict[int, np.ndarray] = {}
        self._late: set[int] = set()
        self.closed = False
        self.lanes = tuple(lanes)
        for lane in self.lanes:
            _register(pool, lane)
        # The lanes' reads beside the caller's; the threads end when the reader is dropped.
        self._lane_threads = futures.ThreadPoolExecutor(
            max(1, len(self.lanes)), thread_name_prefix="kvtier-peer-lane")

    @property
    def counters(self) -> PeerReadCounters:
        return self._totals

    def lookup(self, rank: PeerRank, keys: Sequence[str], heads: tuple[int, ...]) -> PeerLend:
        """Where holder rank `rank` holds the leading run of the pages keyed `keys` (chain
        keys, prefix order): one read of its table into memory of this rank's, then a
        look-up there (tiers/peer_table.py); the sums of `heads` (global) only."""
        if not rank.table_addr or not rank.address:
            raise ConfigError(f"holder rank {rank.rank} of {rank.size} publishes no table of "
                              "its L2: it runs a kvtier older than this reader's; upgrade it")
        pool_heads = rank.head_stop - rank.head_start
        outside = [h for h in heads if not rank.head_start <= h < rank.head_stop]
        if outside:
            raise ConfigError(f"KV head {outside[0]} is not one of holder rank {rank.rank}'s "
                              f"[{rank.head_start}, {rank.head_stop})")
        nbytes = rank.pool_pages * row_dtype(pool_heads).itemsize
        raw = self._scratch.get(rank.rank)
        if raw is None or raw.nbytes < nbytes:
            self._drop_scratch(rank.rank)
            raw = self._scratch[rank.rank] = np.zeros(nbytes, np.uint8)
            self.endpoint.register(int(raw.ctypes.data), nbytes, "cpu")
        raw = raw[:nbytes]
        try:
            self.endpoint.read(rank.address, np.array([[raw.ctypes.data, nbytes]], np.uint64),
                               np.array([[rank.table_addr, nbytes]], np.uint64),
                               self.timeout_s)
        except TransportTimeout:
            self._late.add(rank.rank)
            raise
        hit = lookup(raw, pool_heads, keys)
        local = [h - rank.head_start for h in heads]
        sums = tuple(hit.sums[i * pool_heads + h] for i in range(len(hit.pages)) for h in local)
        return PeerLend(hit.pages, sums, rank.l2_addr, rank.pool_pages, pool_heads,
                        rank.address)

    def _drop_scratch(self, index: int) -> None:
        """Deregister holder rank `index`'s table copy and let it go; one a read timed out
        into goes to _LATE instead."""
        raw = self._scratch.pop(index, None)
        if raw is None:
            return
        if index in self._late:
            self._late.discard(index)
            _LATE.append(raw)
        else:
            self.endpoint.deregister(int(raw.ctypes.data), raw.nbytes)

    def close(self) -> None:
        """Deregister the table copies from the endpoint (the caller's, closed after this or
        not) and end the lane threads. Idempotent; reads after it raise ClosedError."""
        self.closed = True
        for index in list(self._scratch):
            self._drop_scratch(index)
        self._lane_threads.shutdown(wait=True)

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError("this peer reader is closed; open a new one")

    def __enter__(self) -> "PeerReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, contact: PeerContact, keys: Sequence[str], first_page: int,
             pages: Sequence[int]) -> PeerRead:
        """Read the pages keyed `keys` (chain keys of a prefix's pages from its page
        `first_page` on, in order) from the holder `contact` names into `pages` (this rank's
        pool pages, held by the caller, one per key). A holder or transport failure is a
        result, never an exception; only a caller bug raises (pages outside the pool, a
        negative first page, keys and pages that do not pair up)."""
        self._check_open()
        t0 = time.perf_counter()
        ours = [int(p) for p in pages]
        size = self.pool.memory().num_pages
        bad = [p for p in ours if not 0 <= p < size]
        if bad:
            raise CacheUsageError(f"page {bad[0]} is outside this rank's pool (0..{size - 1})")
        if first_page < 0:
            raise CacheUsageError(f"the first page must not be negative, got {first_page}")
        if len(keys) != len(ours):
            raise CacheUsageError(f"{len(keys)} keys for {len(ours)} pages: one page per key")
        got = self._read(contact, list(keys), first_page, ours)
        got = got._replace(seconds=time.perf_counter() - t0)
        t = self._totals
        self._totals = PeerReadCounters(
            t.reads + 1, t.pages + got.pages, t.bytes + got.bytes,
            t.failures + (got.reason in FAILURES),
            t.mismatches + (got.reason is PeerReadOutcome.SUM_MISMATCH),
            t.seconds + got.seconds, t.lookup_s + got.lookup_s, t.transfer_s + got.transfer_s,
            t.verify_s + got.verify_s)
        return got

    def _owners(self, contact: PeerContact) -> list[tuple[PeerRank, tuple[int, ...]]] | None:
        """The holder ranks to read from, each with the heads (global) to read from it: every
        head of this rank's from exactly one holder rank. None: they do not cover them all."""
        missing = set(self.heads.heads())
        out = []
        for rank in contact.ranks:
            heads = tuple(h for h in range(rank.head_start, rank.head_stop) if h in missing)
            if heads:
                missing.difference_update(heads)
                out.append((rank, heads))
        return None if missing else out

    def _read(self, contact: PeerContact, keys: list[str], first_page: int,
              host_pages: list[int]) -> PeerRead:
        owners = self._owners(contact)
        if owners is None:
            self._note(contact.holder, PeerReadOutcome.NO_HEADS,
                       f"its ranks {[(r.head_start, r.head_stop) for r in contact.ranks]} "
                       f"lack some of heads [{self.heads.start}, {self.heads.stop})")
            return PeerRead(0, 0, 0.0, PeerReadOutcome.NO_HEADS)
        if not host_pages:
            return PeerRead(0, 0, 0.0, PeerReadOutcome.ALL)
        t0 = time.perf_counter()
        sources = self._look_up(owners, keys)
        if isinstance(sources, PeerRead):
            return sources
        n = min(len(s.lend.host_pages) for s in sources)  # pages every holder rank lists
        reason = PeerReadOutcome.ALL if n == len(host_pages) else \
            PeerReadOutcome.HOLDER_MISSING_PAGES
        if not n:
            return PeerRead(0, 0, 0.0, reason)
        ours = host_pages[:n]
        memory = _register(self.pool, self.endpoint)
        endpoints = [self.endpoint, *self.lanes]
        for lane in self.lanes:
            _register(self.pool, lane)
        spans = _lane_spans(n, len(endpoints), self._page_bytes(memory, sources, ours))
        t1 = time.perf_counter()
        others = [self._lane_threads.submit(self._read_span, endpoints[k], memory, sources,
                                            ours, lo, hi) for k, (lo, hi) in
                  enumerate(spans) if k]
        try:
            done = [self._read_span(endpoints[0], memory, sources, ours, *spans[0])]
        finally:  # no lane outlives the read (the caller may reuse the pages after)
            futures.wait(others)
        done += [f.result() for f in others]
        nbytes = sum(d.bytes for d in done)
        failed = [d for d in done if d.error is not None]
        if failed:  # a timed-out lane first: its transport may still write the pages
            d = min(failed, key=lambda d: not isinstance(d.error, TransportTimeout))
            why = (PeerReadOutcome.TRANSPORT_TIMEOUT if isinstance(d.error, TransportTimeout)
                   else PeerReadOutcome.TRANSPORT_FAILED)
            return self._failed(d.rank, why, d.error)._replace(bytes=nbytes)
        t2 = t1 + max(d.transfer_s for d in done)
        for k, s in enumerate(sources):  # each holder rank's heads, over the pages still good
            sums = [x for d in done for x in d.sums[k]]
            good = _leading_matches(sums, s.lend.sums, len(s.ours))
            if good < n:
                self._note(s.rank.actor, PeerReadOutcome.SUM_MISMATCH,
                           f"page {first_page + good} of the prefix changed after the look-up")
                n, reason = good, PeerReadOutcome.SUM_MISMATCH
        if n:
            self.pool.verified(ours[:n], _pool_sums(sources, n, self.heads.count))
        return PeerRead(n, nbytes, 0.0, reason, t1 - t0, t2 - t1, time.perf_counter() - t2)

    def _read_span(self, endpoint: TransportEndpoint, memory: PoolMemory, sources: list[_Source],
                   ours: list[int], lo: int, hi: int) -> "_SpanRead":
        """Pages lo..hi-1 of a read through `endpoint`: every holder rank's heads, then their
        sums (while the bytes may still be in cache). A transport error is returned."""
        t0, nbytes = time.perf_counter(), 0
        for s in sources:
            local, remote = self._rows(memory, s, ours, lo, hi)
            try:
                nbytes += endpoint.read(s.lend.address, local, remote, self.timeout_s).bytes
            except Exception as exc:  # noqa: BLE001 - a library's own error too: a miss
                return _SpanRead(nbytes, (), 0.0, s.rank, exc)
        transfer_s = time.perf_counter() - t0
        sums = tuple(self.pool.head_sums(ours[lo:hi], s.ours) for s in sources)
        return _SpanRead(nbytes, sums, transfer_s)

    def _page_bytes(self, memory: PoolMemory, sources: list[_Source], ours: list[int]) -> int:
        """The bytes one page of a read moves, from every holder rank."""
        return sum(int(self._rows(memory, s, ours, 0, 1)[0][:, 1].sum()) for s in sources)

    def raw_read(self, contact: PeerContact, keys: Sequence[str], pages: Sequence[int],
                 start_at: float | None = None) -> RawPeerRead:
        """The benchmark's baseline for `read`: the holder ranks' tables are read first
        (untimed), then the same head objects are moved into `pages` with the transport's
        own calls alone (`TransportEndpoint.raw_read`), timed, the best of RAW_READS (the
        transport's own speed, less the machine's noise); nothing verified. `start_at`: a
        `time.time()` to wait for before the timed reads (an instance's ranks read at once,
        as a request's prefetch has them do)."""
        self._check_open()
        owners = self._owners(contact)
        sources = None if owners is None else self._look_up(owners, list(keys))
        if not isinstance(sources, list):
            raise CacheUsageError(f"peer {contact.holder} cannot be read for the baseline: "
                                  f"{'its ranks lack heads' if sources is None else sources}")
        n = min(len(s.lend.host_pages) for s in sources)
        memory = _register(self.pool, self.endpoint)
        rows = [self._rows(memory, s, [int(p) for p in pages[:n]]) for s in sources]
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))
        seconds = min(sum(self.endpoint.raw_read(s.lend.address, local, remote, self.timeout_s)
                          for s, (local, remote) in zip(sources, rows))
                      for _ in range(RAW_READS))
        nbytes = sum(int(local[:, 1].sum()) for local, _ in rows)
        return RawPeerRead(n, nbytes, seconds)

    def _look_up(self, owners: list[tuple[PeerRank, tuple[int, ...]]], keys: list[str]
                 ) -> list[_Source] | PeerRead:
        """Every holder rank's lend of its heads, or the failed read a look-up ended in."""
        sources = []
        for rank, heads in owners:
            try:
                lend = self.lookup_fn(rank, keys, heads)
                _check_lend(lend, rank, len(heads), len(keys))
            except Exception as exc:  # noqa: BLE001 - whatever the holder's state, a miss here
                return self._failed(rank, PeerReadOutcome.LOOKUP_FAILED, exc)
            sources.append(_Source(rank, lend, [h - self.heads.start for h in heads],
                                   [h - rank.head_start for h in heads]))
        return sources

    def _rows(self, memory: PoolMemory, s: _Source, ours: list[int], lo: int = 0,
              hi: int | None = None) -> tuple:
        """(local, remote) rows of the head objects `s` lists, for our pages `ours[lo:hi]`
        of our pool at `memory` (the read's pages lo..hi-1)."""
        hi = len(ours) if hi is None else min(hi, len(ours))
        local = self.pool.head_regions(memory.addr, memory.num_pages, self.heads.count,
                                       ours[lo:hi], s.ours)
        remote = self.pool.head_regions(s.lend.base_addr, s.lend.pool_pages, s.lend.pool_heads,
                                        s.lend.host_pages[lo:hi], s.theirs)
        return local, remote

    def _failed(self, rank: PeerRank, reason: PeerReadOutcome, exc: Exception) -> PeerRead:
        self._note(rank.actor, reason, f"{type(exc).__name__}: {exc}",
                   exc_info=not isinstance(exc, KvtierError))
        return PeerRead(0, 0, 0.0, reason)

    def _note(self, holder: str, reason: PeerReadOutcome, why: str,
              exc_info: bool = False) -> None:
        """Log a failed or cut-short read: a warning the first time a holder rank (or holder)
        fails this way, then at debug (a dead peer is tried again by every request)."""
        key = (holder, reason)
        first = key not in self._warned
        if first:
            if len(self._warned) >= MAX_WARNED:
                self._warned.clear()
            self._warned.add(key)
        log.log(logging.WARNING if first else logging.DEBUG,
                "a peer L2 read from %s brought nothing more (%s): %s", holder, reason.value,
                why, exc_info=exc_info and first)


def _check_lend(lend: PeerLend, rank: PeerRank, heads: int, asked: int) -> None:
    """Raise unless `lend` answers a look-up of `asked` pages for `heads` heads of `rank`."""
    if not isinstance(lend, PeerLend):
        raise ConfigError(f"the holder answered a {type(lend).__name__}, not a PeerLend")
    if len(lend.host_pages) > asked or len(lend.sums) != len(lend.host_pages) * heads:
        raise ConfigError(f"the holder lists {len(lend.host_pages)} pages with "
                          f"{len(lend.sums)} sums for {asked} pages wanted of {heads} heads")
    if lend.pool_heads != rank.head_stop - rank.head_start:
        raise ConfigError(f"the holder's pool holds {lend.pool_heads} heads, but its contact "
                          f"says [{rank.head_start}, {rank.head_stop})")


class _SpanRead(NamedTuple):
    """What one lane of a read moved: its bytes, each holder rank's sums of its pages (page by
    page, then head), its transport reads' time, and the holder rank whose read failed."""

    bytes: int
    sums: tuple[tuple[int, ...], ...]
    transfer_s: float
    rank: PeerRank | None = None
    error: Exception | None = None


def _lane_spans(pages: int, lanes: int, page_bytes: int) -> list[tuple[int, int]]:
    """Pages 0..pages-1 as up to `lanes` contiguous spans of about equal size, each of at
    least LANE_BYTES (one span for a smaller read)."""
    count = max(1, min(lanes, pages, pages * page_bytes // LANE_BYTES))
    cuts = [pages * k // count for k in range(count + 1)]
    return list(zip(cuts[:-1], cuts[1:]))


def _pool_sums(sources: list[_Source], pages: int, heads: int) -> list[int]:
    """The sums of a read's first `pages` pages, page by page then each of the pool's `heads`
    heads, gathered from what each holder rank lists for its heads."""
    out = [0] * (pages * heads)
    for s in sources:
        width = len(s.ours)
        for page in range(pages):
            for j, head in enumerate(s.ours):
                out[page * heads + head] = s.lend.sums[page * width + j]
    return out


def _leading_matches(got: Sequence[int], want: Sequence[int], heads: int) -> int:
    """Leading pages whose `heads` sums (page by page, then head) all match."""
    for page in range(len(got) // heads):
        row = slice(page * heads, (page + 1) * heads)
        if tuple(got[row]) != tuple(want[row]):
            return page
    return len(got) // heads
