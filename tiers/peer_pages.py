"""Peer-to-peer L2, the data plane: one instance's TP rank reads pages of a prompt prefix that
another instance holds in its L2 straight into its own L2 pages, with a one-sided READ.

Why a read and not the holder pushing: the reader owns the pages the bytes land in, so a
holder that dies or hangs never writes into pages the reader has meanwhile given to someone
else (HandoffEndpoint.read). Why L2 and not L1: L2 in `page_head` keeps each KV head's K (or
V) of a page, over every layer, as one contiguous object, so ranks of different TP sizes move
whole head objects (a holder at TP 1 serves a reader at TP 3 one third of its heads each, a
holder at TP 3 serves a reader at TP 1 one head each); L1 interleaves heads token by token.

The protocol, per reader rank and prompt:
  ask     the reader asks every holder rank that holds some of its heads (`PeerLender.lend`,
          through whatever carries the call: an actor method) where the leading pages of
          the prefix lie in that rank's L2, and gets a `PeerLend`: the L2 page ids, one
          xxh3_64 per (page, head) of their bytes, and how to address its pool
  read    one transport read per holder rank: the head objects of the pages every holder
          rank lent land in the same heads of the reader's pages
  verify  the reader sums what landed and keeps the leading pages whose every head matched

Nothing holds the lent pages on the holder between the ask and the read: a holder that
evicts one and reuses its page meanwhile is caught by the sums (the read then ends before
that page), and a holder must not wait on a peer to manage its own L2. So a lend changes
nothing on the holder (no hit counted, no LRU order refreshed, nothing evicted or locked).
"""
from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, NamedTuple, Sequence

from kvtier.backends.handoff_base import HandoffEndpoint, HandoffTimeout
from kvtier.errors import CacheUsageError, ConfigError, KvtierError
from kvtier.kv_spec import HeadRange
from kvtier.messages import PeerContact, PeerLend, PeerRank
from kvtier.tiers.hierarchical_cache import HierarchicalCache, depth
from kvtier.tiers.page_exchange import PoolMemory, head_regions
from kvtier.tiers.tree_node import TreeNode, as_key

log = logging.getLogger(__name__)

# ask(holder rank, tokens, salt, first page, pages, global heads): that rank's PeerLend
AskFn = Callable[[PeerRank, "list[int]", str, int, int, "tuple[int, ...]"], PeerLend]
MAX_SUMS = 1 << 18  # lent pages whose sums a lender keeps (~100 B each with the dict)
MAX_PARALLEL_ASKS = 8  # holder ranks asked at once (a holder's TP size, at most)
MAX_WARNED = 1024  # (holder rank, reason) pairs warned about before the memory starts over


def _done(fn: Callable, arg: object) -> Future:
    """`fn(arg)` run now, as a finished future (its result or its exception)."""
    future: Future = Future()
    try:
        future.set_result(fn(arg))
    except Exception as exc:  # noqa: BLE001 - the caller reads it from the future
        future.set_exception(exc)
    return future


class PeerReadOutcome(str, enum.Enum):
    """Why a peer read brought fewer pages than asked (ALL: it did not)."""

    ALL = "all"  # every page asked arrived whole and verified
    HOLDER_MISSING_PAGES = "holder_missing_pages"  # a holder rank lent fewer pages: it
    # lacks the rest in L2 (evicted, never held, or their L1->L2 copy has not landed)
    SUM_MISMATCH = "sum_mismatch"  # a page's bytes changed on the holder after it lent them
    NO_HEADS = "no_heads"  # the holder's ranks do not hold every KV head this rank needs
    ASK_FAILED = "ask_failed"  # a holder rank did not answer (gone), or not with a fitting lend
    TRANSPORT_FAILED = "transport_failed"  # a read failed (the holder's endpoint gone, ...)
    TRANSPORT_TIMEOUT = "transport_timeout"  # a read did not finish in time, and the
    # transport may still write the reader's pages until its own timeout ends it (Mooncake:
    # backends/handoff_mooncake.py): give them to nothing else before then


class PeerRead(NamedTuple):
    """What one `PeerReader.read_into` brought: its first `pages` host pages hold the prompt's
    pages, whole and verified; what the others hold is undefined."""

    pages: int
    bytes: int  # moved by the transport, the pages that did not verify included
    seconds: float  # the whole call: asks, reads, checks
    reason: PeerReadOutcome
    ask_s: float = 0.0  # of `seconds`: asking the holder ranks where the pages lie
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
    """Monotonic totals of one reader's read_into calls."""

    reads: int
    pages: int  # verified pages delivered
    bytes: int
    failures: int  # calls that brought nothing because a holder or the transport failed
    mismatches: int  # calls cut short by a page whose bytes did not match their sum
    seconds: float = 0.0  # in read_into, all of it
    ask_s: float = 0.0  # of which asking holder ranks, reading, verifying (PeerRead)
    transfer_s: float = 0.0
    verify_s: float = 0.0


class _Source(NamedTuple):
    """One holder rank a read takes heads from: its lend, and those heads as this rank's
    pool (`ours`) and the holder's (`theirs`) number them, in the same order."""

    rank: PeerRank
    lend: PeerLend
    ours: list[int]
    theirs: list[int]


FAILURES = frozenset({PeerReadOutcome.NO_HEADS, PeerReadOutcome.ASK_FAILED,
                      PeerReadOutcome.TRANSPORT_FAILED, PeerReadOutcome.TRANSPORT_TIMEOUT})


def _open_l2(cache: HierarchicalCache, heads: HeadRange) -> None:
    """Check that `cache` can lend or receive head objects of `heads`, and hold its L2 in
    `page_head` from now on."""
    if not cache.hierarchical:
        raise ConfigError("peer L2 moves pages between L2 pools, and this cache has none: "
                          "enable the hierarchical cache")
    if cache.spec.sliding is not None:
        raise ConfigError("peer L2 moves full-attention KV only; a hybrid model's "
                          "sliding-window KV lives in a sidecar no peer read moves")
    if heads.count != cache.spec.num_kv_heads:
        raise ConfigError(f"KV heads [{heads.start}, {heads.stop}) are {heads.count} heads, "
                          f"but this rank's pool holds {cache.spec.num_kv_heads}: pass the "
                          "rank's own HeadRange.of_rank(total, rank, size)")
    cache.use_head_major_host()


def _register_l2(cache: HierarchicalCache, endpoint: HandoffEndpoint) -> PoolMemory:
    """L2 as it is now, registered on `endpoint` (idempotent; a relayout moves the buffer,
    so every use registers what it is about to address)."""
    l2 = cache.exchange.l2
    endpoint.register(l2.addr, l2.nbytes, l2.device)
    return l2


class PeerLender:
    """The holder side of one TP rank: answers peers asking where pages of a prefix lie in
    its L2. `lend` may run on a thread of its own, beside the cache's owner: it holds the
    cache's guard while it reads the tree and sums pages, so it waits for a cache call in
    progress (milliseconds), never for a scheduling step (HierarchicalCache says why). One
    call at a time."""

    def __init__(self, cache: HierarchicalCache, endpoint: HandoffEndpoint,
                 heads: HeadRange) -> None:
        """`heads`: the KV heads (global indices) this rank's pool holds."""
        _open_l2(cache, heads)
        self.cache, self.endpoint, self.heads = cache, endpoint, heads
        _register_l2(cache, endpoint)
        # ((node id, position), page) -> the page's sums per head of this rank (_sums_of)
        self._sums: OrderedDict[tuple[tuple[int, int], int], tuple[int, ...]] = OrderedDict()

    def lend(self, tokens: Sequence[int], salt: str, first_page: int, num_pages: int,
             heads: Sequence[int]) -> PeerLend:
        """Where pages `first_page .. first_page + num_pages - 1` of the prefix `tokens`
        (cache salt `salt`) lie in this rank's L2: the leading run of them it holds there
        with a landed copy, and each one's sum per head of `heads` (global indices, all of
        this rank's), page by page then head in the order given. Changes nothing but the
        tree's shape (a run the prefix ends inside is split, as by any lookup)."""
        local = [self._local(h) for h in heads]
        if first_page < 0 or num_pages < 0:
            raise CacheUsageError(f"pages {first_page} (first) and {num_pages} (count) must "
                                  "not be negative")
        with self.cache.guard:  # the tree and L2 as they are between the owner's calls
            held = self._held(tokens, salt, first_page, num_pages)
            l2 = _register_l2(self.cache, self.endpoint)
            sums = self._sums_of(held)
        return PeerLend(tuple(page for _, page in held),
                        tuple(sums[key][h] for key in held for h in local), l2.addr,
                        l2.num_pages, self.heads.count, self.endpoint.address())

    def _sums_of(self, held: list[tuple[tuple[int, int], int]]) -> dict:
        """Each lent page's sums over all of this rank's heads, summed once per page: a
        popular prefix is lent to many peers, and summing it again each time would take the
        holder's time between its steps. A page's bytes stay as they are while its node
        holds it at that position of the prefix, so (node, position, page) names them."""
        memo = self._sums
        todo = [key for key in held if key not in memo]
        if todo:
            every = range(self.heads.count)
            flat = self.cache.exchange.l2_head_sums([page for _, page in todo], every)
            n = self.heads.count
            for i, key in enumerate(todo):
                memo[key] = flat[i * n:(i + 1) * n]
            while len(memo) > MAX_SUMS:
                memo.popitem(last=False)
        for key in held:
            memo.move_to_end(key)
        return {key: memo[key] for key in held}

    def _local(self, head: int) -> int:
        """`head` (global) as this rank's pool numbers it."""
        if not self.heads.start <= head < self.heads.stop:
            raise ConfigError(f"KV head {head} is not one of this rank's [{self.heads.start}, "
                              f"{self.heads.stop}); ask the holder rank that holds it")
        return head - self.heads.start

    def _held(self, tokens: Sequence[int], salt: str, first: int, count: int
              ) -> list[tuple[tuple[int, int], int]]:
        """The prefix's pages first.. (at most `count`) up to the first one this rank lacks
        in L2 or whose copy may not have landed: each as ((its node's id, its position in
        the prefix), its L2 page id)."""
        m = self.cache.tree.match_prefix(tokens, touch=False, salt=salt)
        end = max(m.last_device_node, m.last_host_node, key=depth)
        held: list[tuple[tuple[int, int], int] | None] = []
        for node in reversed(list(end.path_to_root())):
            if len(held) >= first + count:
                break
            ok = node.host_value is not None and self._landed(node)
            start = len(held)
            held += ([((node.id, start + i), page) for i, page in enumerate(node.host_value)]
                     if ok else [None] * node.num_pages)
        return list(itertools.takewhile(lambda p: p is not None, held[first:first + count]))

    def _landed(self, node: TreeNode) -> bool:
        """Whether `node`'s L2 copy has landed: the tree records an L1->L2 copy as it starts,
        and the cache's copies in flight (HostCopies) say which have not landed yet. A run
        out of L1 landed before L1 let it go (or came from L3 or a peer, inserted once
        landed)."""
        return node.value is None or not self.cache.copies.in_flight(node.host_value or ())


class PeerReader:
    """The reader side of one TP rank: reads a prefix's pages from a peer instance's L2 into
    host pages of its own, verified. `read_into` touches only the host pages it is given
    (and reads where L2 lies), never the tree: like an L3 read into the pages a prefetch
    holds, it may run on a worker thread while the cache serves; one call at a time."""

    def __init__(self, cache: HierarchicalCache, endpoint: HandoffEndpoint, heads: HeadRange,
                 ask: AskFn, timeout_s: float) -> None:
        """`heads`: the KV heads (global indices) this rank's pool holds. `ask`: asks one
        holder rank for its `PeerLend` (what raises there is a failed ask, never this
        reader's). `timeout_s`: each transport read's limit."""
        _open_l2(cache, heads)
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s must be a positive number of seconds: {timeout_s}")
        self.cache, self.endpoint, self.heads = cache, endpoint, heads
        self.ask, self.timeout_s = ask, timeout_s
        _register_l2(cache, endpoint)
        self._totals = PeerReadCounters(0, 0, 0, 0, 0)
        self._warned: set[tuple[str, PeerReadOutcome]] = set()
        self._asks: ThreadPoolExecutor | None = None  # asks several holder ranks at once

    @property
    def counters(self) -> PeerReadCounters:
        return self._totals

    def close(self) -> None:
        """Stop the threads that ask holder ranks (reads after this ask one at a time)."""
        asks, self._asks = self._asks, None
        if asks is not None:
            asks.shutdown(wait=False, cancel_futures=True)

    def read_into(self, contact: PeerContact, tokens: Sequence[int], salt: str,
                  first_page: int, host_pages: Sequence[int]) -> PeerRead:
        """Read pages `first_page ..` of the prefix `tokens` (cache salt `salt`) from the
        holder `contact` names into `host_pages` (this rank's L2 pages, held by the caller,
        one per page). A holder or transport failure is a result, never an exception; only a
        caller bug raises (host pages outside L2, a negative first page)."""
        t0 = time.perf_counter()
        pages = [int(p) for p in host_pages]
        bad = [p for p in pages if not 0 <= p < self.cache.host_pages]
        if bad:
            raise CacheUsageError(f"host page {bad[0]} is outside L2 "
                                  f"(0..{self.cache.host_pages - 1})")
        if first_page < 0:
            raise CacheUsageError(f"the first page must not be negative, got {first_page}")
        got = self._read(contact, list(as_key(tokens)), salt, first_page, pages)
        got = got._replace(seconds=time.perf_counter() - t0)
        t = self._totals
        self._totals = PeerReadCounters(
            t.reads + 1, t.pages + got.pages, t.bytes + got.bytes,
            t.failures + (got.reason in FAILURES),
            t.mismatches + (got.reason is PeerReadOutcome.SUM_MISMATCH),
            t.seconds + got.seconds, t.ask_s + got.ask_s, t.transfer_s + got.transfer_s,
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

    def _read(self, contact: PeerContact, tokens: list[int], salt: str, first_page: int,
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
        sources = self._ask_all(owners, tokens, salt, first_page, len(host_pages))
        if isinstance(sources, PeerRead):
            return sources
        n = min(len(s.lend.host_pages) for s in sources)  # pages every holder rank lent
        reason = PeerReadOutcome.ALL if n == len(host_pages) else \
            PeerReadOutcome.HOLDER_MISSING_PAGES
        if not n:
            return PeerRead(0, 0, 0.0, reason)
        ours, nbytes = host_pages[:n], 0
        _register_l2(self.cache, self.endpoint)
        t1 = time.perf_counter()
        for s in sources:
            local, remote = self._rows(s, ours)
            try:
                nbytes += self.endpoint.read(s.lend.address, local, remote,
                                             self.timeout_s).bytes
            except Exception as exc:  # noqa: BLE001 - a library's own error too: a miss
                why = (PeerReadOutcome.TRANSPORT_TIMEOUT if isinstance(exc, HandoffTimeout)
                       else PeerReadOutcome.TRANSPORT_FAILED)
                return self._failed(s.rank, why, exc)._replace(bytes=nbytes)
        t2 = time.perf_counter()
        for s in sources:  # each holder rank's heads, over the pages still good
            good = _leading_matches(self.cache.exchange.l2_head_sums(ours[:n], s.ours),
                                    s.lend.sums, len(s.ours))
            if good < n:
                self._note(s.rank.actor, PeerReadOutcome.SUM_MISMATCH,
                           f"page {first_page + good} of the prefix changed after it was lent")
                n, reason = good, PeerReadOutcome.SUM_MISMATCH
        return PeerRead(n, nbytes, 0.0, reason, t1 - t0, t2 - t1, time.perf_counter() - t2)

    def raw_read(self, contact: PeerContact, tokens: Sequence[int], salt: str,
                 first_page: int, host_pages: Sequence[int]) -> RawPeerRead:
        """The benchmark's baseline for `read_into`: the holder ranks are asked first
        (untimed), then the same head objects are moved into `host_pages` with the
        transport's own calls alone (`HandoffEndpoint.raw_read`), timed; nothing verified."""
        owners = self._owners(contact)
        sources = None if owners is None else self._ask_all(
            owners, list(as_key(tokens)), salt, first_page, len(host_pages))
        if not isinstance(sources, list):
            raise CacheUsageError(f"peer {contact.holder} cannot be read for the baseline: "
                                  f"{'its ranks lack heads' if sources is None else sources}")
        n = min(len(s.lend.host_pages) for s in sources)
        nbytes, seconds = 0, 0.0
        for s in sources:
            local, remote = self._rows(s, [int(p) for p in host_pages[:n]])
            seconds += self.endpoint.raw_read(s.lend.address, local, remote, self.timeout_s)
            nbytes += int(local[:, 1].sum())
        return RawPeerRead(n, nbytes, seconds)

    def _ask_all(self, owners: list[tuple[PeerRank, tuple[int, ...]]], tokens: list[int],
                 salt: str, first_page: int, count: int) -> list[_Source] | PeerRead:
        """Every holder rank's lend of its heads, or the failed read an ask ended in. Several
        holder ranks (a holder of a larger TP size) are asked at once: each answers between
        its own steps, so asking one after another would add their waits up."""
        def one(owner: tuple[PeerRank, tuple[int, ...]]) -> PeerLend:
            rank, heads = owner
            lend = self.ask(rank, tokens, salt, first_page, count, heads)
            _check_lend(lend, rank, len(heads), count)
            return lend

        if len(owners) == 1:
            pending = [_done(one, owners[0])]
        else:
            if self._asks is None:
                self._asks = ThreadPoolExecutor(MAX_PARALLEL_ASKS, "kvtier-peer-ask")
            pending = [self._asks.submit(one, owner) for owner in owners]
        sources = []
        for (rank, heads), future in zip(owners, pending):
            try:
                lend = future.result()
            except Exception as exc:  # noqa: BLE001 - whatever the holder does, a miss here
                return self._failed(rank, PeerReadOutcome.ASK_FAILED, exc)
            sources.append(_Source(rank, lend, [h - self.heads.start for h in heads],
                                   [h - rank.head_start for h in heads]))
        return sources

    def _rows(self, s: _Source, ours: list[int]) -> tuple:
        """(local, remote) rows of the head objects `s` lends, for our pages `ours`."""
        local = self.cache.exchange.l2_head_regions(self.heads.count, ours, s.ours)
        remote = head_regions(self.cache.spec, s.lend.pool_heads, s.lend.base_addr,
                              s.lend.pool_pages, s.lend.host_pages[:len(ours)], s.theirs)
        return local, remote

    def _failed(self, rank: PeerRank, reason: PeerReadOutcome, exc: Exception) -> PeerRead:
        self._note(rank.actor, reason, f"{type(exc).__name__}: {exc}",
                   exc_info=not isinstance(exc, KvtierError))
        return PeerRead(0, 0, 0.0, reason)

    def _note(self, holder: str, reason: PeerReadOutcome, why: str,
              exc_info: bool = False) -> None:
        """Log a failed or cut-short read: a warning the first time a holder rank (or holder)
        fails this way, then at debug (a dead peer is asked again by every request)."""
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
    """Raise unless `lend` answers an ask of `asked` pages for `heads` heads of `rank`."""
    if not isinstance(lend, PeerLend):
        raise ConfigError(f"the holder answered a {type(lend).__name__}, not a PeerLend")
    if len(lend.host_pages) > asked or len(lend.sums) != len(lend.host_pages) * heads:
        raise ConfigError(f"the holder lent {len(lend.host_pages)} pages with "
                          f"{len(lend.sums)} sums for {asked} pages asked of {heads} heads")
    if lend.pool_heads != rank.head_stop - rank.head_start:
        raise ConfigError(f"the holder's pool holds {lend.pool_heads} heads, but its contact "
                          f"says [{rank.head_start}, {rank.head_stop})")


def _leading_matches(got: Sequence[int], want: Sequence[int], heads: int) -> int:
    """Leading pages whose `heads` sums (page by page, then head) all match."""
    for page in range(len(got) // heads):
        row = slice(page * heads, (page + 1) * heads)
        if tuple(got[row]) != tuple(want[row]):
            return page
    return len(got) // heads
