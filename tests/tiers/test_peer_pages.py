"""Peer-to-peer L2 in one process (tiers/peer_pages, tiers/peer_table): a reader instance's
ranks look a prompt's pages up in a holder instance's table and read them from its L2 over a
real one-sided READ (simulated, NIXL, Mooncake), with each side at its own TP size; what
arrives is the holder's bytes, head by head, or nothing of a page: a page the holder
overwrote after the look-up, a holder that lacks pages, a dead holder or endpoint cut the
result short and never raise."""
from __future__ import annotations

import dataclasses
import sys
import threading
import time

import numpy as np
import pytest
import torch
import xxhash
from cache_builder import build_cache

from kvtier.backends import transport_address
from kvtier.backends.transport_base import TransportTimeout, TransportUnavailable
from kvtier.backends.transport_registry import open_endpoint
from kvtier.errors import CacheUsageError, ClosedError, ConfigError
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.messages import PeerContact
from kvtier.tiers.page_exchange import head_object_bytes
from kvtier.tiers import peer_pages
from kvtier.tiers.peer_pages import (CachePool, PeerLender, PeerReader,
                                     PeerReadOutcome)
from kvtier.tiers.peer_table import PeerTable, lookup

PAGE, HEADS, LAYERS, DIM = 4, 6, 2, 8  # 6 KV heads: TP 1, 2 and 3 split them
PAGES = 6
PROMPT = list(range(100, 100 + PAGES * PAGE)) + [7, 8]  # and a partial page
SALT = "tenant"
TIMEOUT_S = 10.0


def head_object(head: int, page: int, part: int, version: int = 0) -> torch.Tensor:
    """The bytes of global KV head `head`'s K (part 0) or V of page `page` of PROMPT: the
    same on every rank holding that head, whatever its TP size."""
    n = head_object_bytes(KVSpec(LAYERS, 1, DIM, PAGE, torch.float32))
    rng = np.random.default_rng([head, page, part, version])
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


class Instance:
    """One instance: a cache and an endpoint per TP rank."""

    def __init__(self, kind: str, tp: int, role: str, pages: int = 16):
        spec = KVSpec(LAYERS, HEADS // tp, DIM, PAGE, torch.float32)
        self.tp = tp
        self.caches = [build_cache(spec, pages, model="tiny", tp_rank=r, tp_size=tp)
                       for r in range(tp)]
        self.endpoints = [open_endpoint(kind, f"{role}-{r}") for r in range(tp)]

    def heads(self, rank: int) -> HeadRange:
        return HeadRange.of_rank(HEADS, rank, self.tp)

    def close(self):
        for endpoint in self.endpoints:
            endpoint.close()
        for cache in self.caches:
            cache.close()


class Holder(Instance):
    """A holder instance whose rank r holds `pages[r]` leading pages of PROMPT in L2."""

    def __init__(self, kind: str, tp: int, pages: int = 16):
        super().__init__(kind, tp, "holder", pages)
        self.lenders = [PeerLender(CachePool(c, self.heads(r)), e, self.heads(r), c.publish_l2)
                        for r, (c, e) in enumerate(zip(self.caches, self.endpoints))]

    def fill(self, pages: int | list[int] = PAGES) -> None:
        for r, cache in enumerate(self.caches):
            n = pages if isinstance(pages, int) else pages[r]
            host = cache.allocate_host(n)
            for i, page in enumerate(host):
                self.write(r, page, i)
            res = cache.tree.insert_host(PROMPT[:n * PAGE], host, salt=SALT)
            assert res.new_pages == n

    def write(self, rank: int, host_page: int, page: int, version: int = 0) -> None:
        """Put page `page` of PROMPT (bytes `version`) into L2 page `host_page` of `rank`."""
        pool = self.caches[rank].host_pool
        for local, head in enumerate(self.heads(rank).heads()):
            for part in (0, 1):
                pool.page_head_view(host_page, local, part).copy_(
                    head_object(head, page, part, version))

    def contact(self) -> PeerContact:
        ranks = tuple(lender.contact(r, self.tp, f"lender-{r}", "peers")
                      for r, lender in enumerate(self.lenders))
        return PeerContact("ns", "holder-0", ranks)

    def close(self):
        for lender in self.lenders:
            lender.close()
        super().close()


class Reader(Instance):
    """A reader instance; `after_lookup(rank, lend)`, when given, runs on each look-up's
    result before the read goes on (what the holder does meanwhile) and returns it."""

    def __init__(self, kind: str, tp: int, after_lookup=None, lanes: int = 0):
        super().__init__(kind, tp, "reader")
        self.lanes = [[open_endpoint(kind, f"reader-{r}-lane-{k}") for k in range(lanes)]
                      for r in range(tp)]
        self.readers = [PeerReader(CachePool(c, self.heads(r)), e, self.heads(r), TIMEOUT_S,
                                   lanes=self.lanes[r])
                        for r, (c, e) in enumerate(zip(self.caches, self.endpoints))]
        self.asked: list[tuple] = []  # (holder rank, pages wanted, heads) of each look-up
        for reader in self.readers:
            reader.lookup_fn = self._recording(reader, after_lookup)

    def _recording(self, reader, after_lookup):
        def look(rank, keys, heads):
            self.asked.append((rank.rank, len(keys), heads))
            lend = reader.lookup(rank, keys, heads)
            return after_lookup(rank, lend) if after_lookup else lend
        return look

    def read(self, contact: PeerContact, first_page: int = 0, pages: int = PAGES):
        """Every rank's read of PROMPT's pages first_page.. into fresh L2 pages:
        [(result, host pages)] by rank."""
        out = []
        for cache, reader in zip(self.caches, self.readers):
            host = cache.allocate_host(pages)
            keys = cache.namespace.page_hashes(PROMPT[:(first_page + pages) * PAGE], PAGE, SALT)
            out.append((reader.read(contact, keys[first_page:], first_page, host), host))
        return out

    def close(self):
        for reader in self.readers:
            reader.close()
        for endpoint in (e for lanes in self.lanes for e in lanes):
            endpoint.close()
        super().close()

    def check(self, rank: int, host: list[int], first_page: int, count: int) -> None:
        """L2 pages `host[:count]` of `rank` hold PROMPT's pages first_page.., every head."""
        pool = self.caches[rank].host_pool
        for i in range(count):
            for local, head in enumerate(self.heads(rank).heads()):
                for part in (0, 1):
                    assert torch.equal(pool.page_head_view(host[i], local, part),
                                       head_object(head, first_page + i, part)), (i, head)


KINDS = ["simulated", "nixl", "mooncake"]
REAL = KINDS[1:]  # each endpoint of these takes a second or so to close (Mooncake): the real
# transports run fewer TP combinations; the simulated one runs them all
_OPENS: dict[str, str] = {}  # kind -> why it cannot open here ("" : it can)


@pytest.fixture
def kind(request):
    """The transport `request.param`; the test is skipped where its library cannot open."""
    if request.param != "simulated":
        pytest.importorskip("nixl._api" if request.param == "nixl" else "mooncake.engine")
        if request.param not in _OPENS:
            try:
                open_endpoint(request.param, "probe").close()
                _OPENS[request.param] = ""
            except TransportUnavailable as exc:
                _OPENS[request.param] = str(exc)
        if _OPENS[request.param]:
            pytest.skip(f"{request.param} cannot open here: {_OPENS[request.param]}")
    return request.param


def cases(simulated: list[tuple], real: list[tuple]) -> list[tuple]:
    """Parameters (kind, *case): every simulated case, the real transports' few."""
    return [("simulated", *c) for c in simulated] + [(k, *c) for k in REAL for c in real]


@pytest.fixture
def instances():
    """Instances a test builds, closed after it (readers first: they hold no peer's memory)."""
    made: list[Instance] = []
    yield made
    for inst in reversed(made):
        inst.close()


def pair(kind: str, holder_tp: int, reader_tp: int, instances, after_lookup=None):
    holder = Holder(kind, holder_tp)
    instances.append(holder)
    reader = Reader(kind, reader_tp, after_lookup)
    instances.append(reader)
    return holder, reader


@pytest.mark.parametrize("kind, holder_tp, reader_tp, first_page", cases(
    [(h, r, f) for h, r in [(1, 1), (3, 1), (1, 3), (3, 2), (2, 3)] for f in (0, 2)],
    [(1, 1, 0), (3, 2, 2)]), indirect=["kind"])
def test_every_page_lands_with_the_holders_bytes_across_tp_sizes(kind, instances, holder_tp,
                                                                  reader_tp, first_page):
    holder, reader = pair(kind, holder_tp, reader_tp, instances)
    holder.fill()
    want = PAGES - first_page
    for rank, (got, host) in enumerate(reader.read(holder.contact(), first_page, want)):
        assert (got.pages, got.reason) == (want, PeerReadOutcome.ALL)
        heads = reader.heads(rank).count
        assert got.bytes == want * heads * 2 * head_object_bytes(reader.caches[rank].spec)
        reader.check(rank, host, first_page, want)
        assert reader.readers[rank].counters[:5] == (1, want, got.bytes, 0, 0)
    # each reader rank looked up only the holder ranks with its heads, for just those heads
    assert sorted(h for _, _, heads in reader.asked for h in heads) == list(range(HEADS))
    assert all(n == want for _, n, _ in reader.asked)


@pytest.mark.parametrize("kind, holder_tp, reader_tp",
                         cases([(1, 1), (3, 1), (1, 3)], [(1, 1)]), indirect=["kind"])
def test_a_page_overwritten_after_the_lookup_ends_the_read_before_it(kind, instances,
                                                                      holder_tp, reader_tp):
    """The holder evicted page 3 and reused its L2 page between the look-up and the read:
    the read sees other bytes under the listed sums and keeps only pages 0..2 (never wrong
    bytes)."""
    holder = Holder(kind, holder_tp)
    instances.append(holder)
    reader: list[Reader] = []

    def then_reuse(rank, lend):  # other bytes after each look-up: each rank sees a change
        holder.write(rank.rank, lend.host_pages[3], 3, version=len(reader[0].asked))
        return lend

    reader.append(Reader(kind, reader_tp, then_reuse))
    instances.append(reader[0])
    holder.fill()
    for rank, (got, host) in enumerate(reader[0].read(holder.contact())):
        assert (got.pages, got.reason) == (3, PeerReadOutcome.SUM_MISMATCH)
        reader[0].check(rank, host, 0, 3)
        assert reader[0].readers[rank].counters.mismatches == 1


@pytest.mark.parametrize("kind", KINDS, indirect=True)
def test_a_holder_lacking_pages_gives_the_leading_run_every_rank_holds(kind, instances):
    """Holder rank 1 (of 2) holds only 2 pages, rank 0 holds 4: a TP 1 reader needs every
    head, so 2 pages, and reads only those from either."""
    holder, reader = pair(kind, 2, 1, instances)
    holder.fill([4, 2])
    ((got, host),) = reader.read(holder.contact())
    assert (got.pages, got.reason) == (2, PeerReadOutcome.HOLDER_MISSING_PAGES)
    reader.check(0, host, 0, 2)
    assert got.bytes == 2 * HEADS * 2 * head_object_bytes(reader.caches[0].spec)  # 2 pages read


@pytest.mark.parametrize("kind", KINDS, indirect=True)
def test_a_holder_endpoint_gone_after_the_lookup_is_a_failed_read(kind, instances):
    """The holder's endpoint closes between the look-up and the read (the instance going
    away): the read fails, nothing is kept; again, its table cannot be read at all."""
    holder = Holder(kind, 1)
    instances.append(holder)

    def then_close(rank, lend):
        holder.endpoints[rank.rank].close()
        return lend

    reader = Reader(kind, 1, then_close)
    instances.append(reader)
    holder.fill()
    contact = holder.contact()  # as the directory keeps it
    ((got, _),) = reader.read(contact)
    assert (got.pages, got.reason) == (0, PeerReadOutcome.TRANSPORT_FAILED)
    ((got, _),) = reader.read(contact)
    assert (got.pages, got.reason) == (0, PeerReadOutcome.LOOKUP_FAILED)
    assert reader.readers[0].counters[:5] == (2, 0, 0, 2, 0)


@pytest.mark.parametrize("kind, holder_tp, reader_tp, lanes",
                         cases([(1, 1, 1), (3, 1, 2), (1, 3, 1), (2, 3, 2)],
                               [(1, 1, 1), (3, 2, 1)]), indirect=["kind"])
def test_a_read_in_lanes_lands_every_page_and_checks_each_lanes_share(kind, instances,
                                                                      holder_tp, reader_tp,
                                                                      lanes, monkeypatch):
    """Each rank's read split among its endpoints (pages 0-2 and 3-5 with one lane more):
    every page lands whole; a page overwritten after the look-up in the last lane's share
    ends the read before it; the lanes' endpoints moved their shares."""
    import kvtier.tiers.peer_pages as peer_pages
    monkeypatch.setattr(peer_pages, "LANE_BYTES", 1)  # these pages are small: split anyway
    holder = Holder(kind, holder_tp)
    instances.append(holder)
    change = {"on": False}

    def maybe_reuse(rank, lend):
        if change["on"]:
            holder.write(rank.rank, lend.host_pages[4], 4, version=1)
        return lend

    reader = Reader(kind, reader_tp, maybe_reuse, lanes=lanes)
    instances.append(reader)
    holder.fill()
    for rank, (got, host) in enumerate(reader.read(holder.contact())):
        assert (got.pages, got.reason) == (PAGES, PeerReadOutcome.ALL)
        reader.check(rank, host, 0, PAGES)
        assert all(e.counters.read_bytes > 0 for e in reader.lanes[rank])
    change["on"] = True
    for rank, (got, host) in enumerate(reader.read(holder.contact())):
        assert (got.pages, got.reason) == (4, PeerReadOutcome.SUM_MISMATCH)
        reader.check(rank, host, 0, 4)


@pytest.mark.parametrize("kind", KINDS, indirect=True)
def test_a_lane_whose_holder_is_gone_fails_the_whole_read(kind, instances, monkeypatch):
    """The holder's endpoint closes after the look-up: every lane's read fails, the read
    brings nothing (no lane's share is kept), and the lanes have all ended."""
    import kvtier.tiers.peer_pages as peer_pages
    monkeypatch.setattr(peer_pages, "LANE_BYTES", 1)
    holder = Holder(kind, 1)
    instances.append(holder)

    def then_close(rank, lend):
        holder.endpoints[rank.rank].close()
        return lend

    reader = Reader(kind, 1, then_close, lanes=2)
    instances.append(reader)
    holder.fill()
    ((got, _),) = reader.read(holder.contact())
    assert (got.pages, got.reason) == (0, PeerReadOutcome.TRANSPORT_FAILED)
    assert reader.readers[0].counters[:5] == (1, 0, 0, 1, 0)


def test_lane_spans_split_pages_evenly_and_keep_small_reads_whole():
    from kvtier.tiers.peer_pages import LANE_BYTES, _lane_spans
    assert _lane_spans(32, 2, LANE_BYTES) == [(0, 16), (16, 32)]
    assert _lane_spans(7, 3, LANE_BYTES) == [(0, 2), (2, 4), (4, 7)]
    assert _lane_spans(3, 2, LANE_BYTES // 2) == [(0, 3)]  # 1.5 x LANE_BYTES: one lane
    assert _lane_spans(4, 2, LANE_BYTES // 2) == [(0, 2), (2, 4)]
    assert _lane_spans(1, 2, LANE_BYTES * 8) == [(0, 1)]
    assert _lane_spans(5, 1, LANE_BYTES) == [(0, 5)]


def test_a_failed_lookup_or_a_lend_that_does_not_fit_is_a_miss(instances):
    holder, reader = pair("simulated", 3, 1, instances)
    holder.fill()
    looked_up = reader.readers[0].lookup_fn

    def dead(rank, keys, heads):
        raise ConnectionError(f"the holder {rank.actor} is gone")

    reader.readers[0].lookup_fn = dead
    ((got, _),) = reader.read(holder.contact())
    assert (got.pages, got.bytes, got.reason) == (0, 0, PeerReadOutcome.LOOKUP_FAILED)

    def too_few_sums(rank, keys, heads):
        lend = looked_up(rank, keys, heads)
        return dataclasses.replace(lend, sums=lend.sums[1:])

    reader.readers[0].lookup_fn = too_few_sums
    ((got, _),) = reader.read(holder.contact())
    assert (got.pages, got.reason) == (0, PeerReadOutcome.LOOKUP_FAILED)
    assert reader.readers[0].counters[:5] == (2, 0, 0, 2, 0)


def test_a_timed_out_read_says_so(instances):
    """The transport may still write the reader's pages after a timeout: the reason tells."""
    holder, reader = pair("simulated", 1, 1, instances)
    holder.fill()
    endpoint = reader.endpoints[0]
    calls = []
    real = endpoint.read

    def hung(*args):
        calls.append(args)
        if len(calls) == 1:  # the table
            return real(*args)
        raise TransportTimeout("the peer did not answer in 10 s")

    endpoint.read = hung
    ((got, _),) = reader.read(holder.contact())
    assert (got.pages, got.reason) == (0, PeerReadOutcome.TRANSPORT_TIMEOUT)


def registered(endpoint) -> int:
    """How many regions `endpoint` registered, as a peer taking its address sees them."""
    return len(transport_address.decode(endpoint.address()).regions)


@pytest.mark.parametrize("kind", KINDS[:2], indirect=True)
def test_table_copies_are_deregistered_when_replaced_and_at_close(kind, instances):
    """A holder rank with a larger pool than the last one at its index makes the reader copy
    its table into a larger buffer: the smaller one is deregistered, not left behind; close
    deregisters the rest. The endpoint (the caller's) stays open and usable."""
    small, big = Holder(kind, 1), Holder(kind, 1, pages=32)
    instances += [small, big]
    reader = Reader(kind, 1)
    instances.append(reader)
    small.fill()
    big.fill()
    endpoint, pool_only = reader.endpoints[0], registered(reader.endpoints[0])
    for holder in (small, big, small, big):
        ((got, host),) = reader.read(holder.contact())
        assert got.reason is PeerReadOutcome.ALL
        reader.check(0, host, 0, PAGES)
        assert registered(endpoint) == pool_only + 1  # one table copy, however often grown
    reader.readers[0].close()
    assert registered(endpoint) == pool_only
    with pytest.raises(ClosedError):
        reader.read(small.contact())


def test_a_table_copy_a_read_timed_out_into_stays_registered_and_allocated(instances):
    """The transport may still write a copy its read timed out into: replaced, it is kept
    (registered, allocated), never freed under the late write."""
    small, big = Holder("simulated", 1), Holder("simulated", 1, pages=32)
    instances += [small, big]
    reader = Reader("simulated", 1)
    instances.append(reader)
    endpoint, pool_only = reader.endpoints[0], registered(reader.endpoints[0])
    real = endpoint.read

    def hung(*args):
        raise TransportTimeout("the peer did not answer in 10 s")
    endpoint.read = hung
    ((got, _),) = reader.read(small.contact())
    assert got.reason is PeerReadOutcome.LOOKUP_FAILED
    late = len(peer_pages._LATE)
    endpoint.read = real
    big.fill()
    ((got, _),) = reader.read(big.contact())
    assert got.reason is PeerReadOutcome.ALL
    assert registered(endpoint) == pool_only + 2 and len(peer_pages._LATE) == late + 1


def test_holder_ranks_that_miss_some_heads_are_not_looked_up(instances):
    holder, reader = pair("simulated", 3, 1, instances)
    holder.fill()
    partial = holder.contact()
    partial = PeerContact(partial.namespace, partial.holder, partial.ranks[:2])
    ((got, _),) = reader.read(partial)
    assert (got.pages, got.reason) == (0, PeerReadOutcome.NO_HEADS) and not reader.asked
    ((got, _),) = reader.read(holder.contact(), pages=0)
    assert (got.pages, got.reason) == (0, PeerReadOutcome.ALL) and not reader.asked


def test_the_table_lists_landed_copies_only_and_drops_freed_pages(instances):
    """A run whose L1->L2 copy has not been seen landing is not listed; once it has, it is.
    A run evicted from L2 leaves the table before its pages can be reused. A look-up changes
    nothing on the holder: no hit, no LRU stamp, no lock."""
    holder, reader = pair("simulated", 1, 1, instances)
    cache = holder.caches[0]
    tokens = PROMPT[:4 * PAGE]
    lookup = cache.lookup(tokens, salt=SALT)
    pages = cache.allocate(4)
    cache.finish(lookup, tokens, pages)  # write-through: the L1->L2 copy starts
    assert cache.copies
    ((got, _),) = reader.read(holder.contact(), pages=4)
    assert (got.pages, got.reason) == (0, PeerReadOutcome.HOLDER_MISSING_PAGES)
    cache.flush()
    nodes = cache.tree.nodes()
    before = [(n.hit_count, n.last_access, n.lock_ref, n.host_ref) for n in nodes]
    ((got, _),) = reader.read(holder.contact(), first_page=1, pages=5)
    assert (got.pages, got.reason) == (3, PeerReadOutcome.HOLDER_MISSING_PAGES)  # 1..3
    assert [(n.hit_count, n.last_access, n.lock_ref, n.host_ref) for n in nodes] == before
    cache.evict_device(cache.device_pages)
    assert cache.evict_host(cache.host_pages).freed_pages == 4
    ((got, _),) = reader.read(holder.contact(), pages=4)
    assert got.pages == 0
    assert not holder.lenders[0].table.rows.view(np.uint64).any()  # every row cleared


def test_a_lookup_refuses_heads_the_holder_rank_does_not_hold(instances):
    holder, reader = pair("simulated", 3, 1, instances)
    holder.fill()
    rank = holder.contact().ranks[1]  # heads [2, 4)
    keys = reader.caches[0].namespace.page_hashes(PROMPT, PAGE, SALT)[:2]
    with pytest.raises(ConfigError, match="not one of holder rank 1's"):
        reader.readers[0].lookup(rank, keys, (3, 4))
    assert len(reader.readers[0].lookup(rank, keys, (3, 2)).sums) == 2 * 2


def test_a_page_is_summed_once_when_it_lands_and_never_for_a_read(instances, monkeypatch):
    """The holder sums a page as it enters its table; reads cost the holder nothing."""
    holder, reader = pair("simulated", 1, 1, instances)
    cache = holder.caches[0]
    summed = []
    real = cache.exchange.l2_head_sums
    monkeypatch.setattr(cache.exchange, "l2_head_sums",
                        lambda pages, heads: summed.append(list(pages)) or real(pages, heads))
    holder.fill()
    assert summed == [list(cache.tree.match_prefix(PROMPT, salt=SALT).last_host_node.host_value)]
    for _ in range(3):
        ((got, _),) = reader.read(holder.contact())
        assert got.pages == PAGES
    assert len(summed) == 1


@pytest.mark.parametrize("reader_tp", [1, 3])
def test_a_page_a_read_verified_is_listed_with_its_sums_and_never_summed_again(
        instances, monkeypatch, reader_tp):
    """The reader's own table lists the pages a read brought with the sums the read checked
    (gathered across the holder ranks it read each head from), summing none of them; pages
    freed before they were listed leave nothing behind: written again with other bytes,
    they are listed with the sums of those."""
    holder, reader = pair("simulated", 2, reader_tp, instances)
    holder.fill()
    summed: list[list[int]] = []
    tables = []
    for cache in reader.caches:
        real = cache.exchange.l2_head_sums
        monkeypatch.setattr(cache.exchange, "l2_head_sums",
                            lambda pages, heads, real=real: summed.append(list(pages))
                            or real(pages, heads))
        tables.append(PeerTable(cache.host_pool.num_pages, cache.spec.num_kv_heads))
        cache.publish_l2(tables[-1])
    keys = reader.caches[0].namespace.page_hashes(PROMPT, PAGE, SALT)
    reads = reader.read(holder.contact())
    assert summed  # the reads' own checks
    summed.clear()
    for rank, (got, host) in enumerate(reads):
        cache, heads = reader.caches[rank], reader.heads(rank).count
        assert (got.pages, len(cache.peer_sums)) == (PAGES, PAGES)
        assert cache.tree.insert_host(PROMPT[:PAGES * PAGE], host, salt=SALT).new_pages == PAGES
        assert (summed, len(cache.peer_sums)) == ([], 0)
        listed = lookup(tables[rank].rows.view(np.uint8).copy(), heads, keys)
        assert listed.pages == tuple(host)
        assert listed.sums == cache.exchange.l2_head_sums(host, range(heads))  # the bytes'
        summed.clear()
    cache = reader.caches[0]
    ((got, host),) = [reader.read(holder.contact())[0]]  # rank 0 again, then freed unlisted
    assert got.pages == PAGES and len(cache.peer_sums) == PAGES
    cache.release_host_pages(host)
    assert len(cache.peer_sums) == 0
    summed.clear()
    other = PROMPT[1:PAGES * PAGE + 1]  # another prompt's pages, in pages the read had used
    again = cache.allocate_host(PAGES)
    assert sorted(again) == sorted(host)
    for page in again:
        cache.host_pool.page_head_view(page, 0, 0).fill_(page)
    cache.tree.insert_host(other, again, salt=SALT)
    assert summed == [again]
    want = cache.namespace.page_hashes(other, PAGE, SALT)
    assert lookup(tables[0].rows.view(np.uint8).copy(), reader.heads(0).count, want).sums \
        == cache.exchange.l2_head_sums(again, range(reader.heads(0).count))


def test_reads_beside_an_owner_that_keeps_reusing_l2_never_deliver_wrong_bytes(instances):
    """The owner evicts the prompt's L2 pages and writes them again into other L2 pages
    (other bytes each round: a recomputed prompt), while a reader looks up and reads on
    another thread: every page a read keeps holds the prompt's page of one round, head by
    head (rows the owner clears or rewrites mid-read are misses, never wrong bytes)."""
    holder, reader = pair("simulated", 1, 1, instances)
    holder.fill()
    cache, pool = holder.caches[0], reader.caches[0].host_pool
    rounds, stop = 60, threading.Event()

    def page_bytes(views) -> bytes:
        return b"".join(v.numpy().tobytes() for v in views)

    objects = {(version, page): [head_object(h, page, part, version)
                                 for h in range(HEADS) for part in (0, 1)]
               for page in range(PAGES) for version in range(rounds)}
    valid = {(page, page_bytes(views)) for (_, page), views in objects.items()}

    def kept_right(host: list[int], count: int) -> bool:
        return all((i, page_bytes(pool.page_head_view(host[i], h, part)
                                  for h in range(HEADS) for part in (0, 1))) in valid
                   for i in range(count))

    failed: list[BaseException] = []

    def owner() -> None:
        try:
            for version in range(1, rounds):
                cache.evict_host(PAGES)
                spare = cache.allocate_host(version % 3)  # so the pages differ each round
                host = cache.allocate_host(PAGES)
                for i, page in enumerate(host):  # as a copy lands
                    views = [holder.caches[0].host_pool.page_head_view(page, h, part)
                             for h in range(HEADS) for part in (0, 1)]
                    for view, obj in zip(views, objects[version, i]):
                        view.copy_(obj)
                assert cache.tree.insert_host(PROMPT[:PAGES * PAGE], host,
                                              salt=SALT).new_pages == PAGES
                cache.release_host_pages(spare)
                time.sleep(0.003)  # held a while: some reads find it whole
        except BaseException as exc:  # noqa: BLE001 - the test fails with it below
            failed.append(exc)
        finally:
            stop.set()

    churn = threading.Thread(target=owner)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the threads take turns often: reuse lands between steps
    churn.start()
    kept = reads = 0
    try:
        while not stop.is_set() and reads < 500:
            ((got, host),) = reader.read(holder.contact())
            reads += 1
            assert kept_right(host, got.pages), got
            kept += got.pages
            reader.caches[0].release_host_pages(host)
            time.sleep(0.001)  # the owner's turn (the GIL)
    finally:
        churn.join(30)
        sys.setswitchinterval(switch)
    assert not failed, failed
    ((got, host),) = reader.read(holder.contact())  # the owner is done: the whole prompt
    assert (got.pages, got.reason) == (PAGES, PeerReadOutcome.ALL)
    assert kept_right(host, PAGES)
    print(f"{reads} reads beside the owner kept {kept} pages")


def test_a_lender_lists_what_l2_held_before_it_opened(instances):
    """A rank that starts lending (a peer_open after L2 has filled) lists L2 as it is."""
    holder, reader = pair("simulated", 1, 1, instances)
    holder.fill()
    holder.lenders[0].close()  # the cache forgets that table; a new lender starts over
    cache = holder.caches[0]
    holder.lenders[0] = PeerLender(CachePool(cache, holder.heads(0)), holder.endpoints[0],
                                   holder.heads(0), cache.publish_l2)
    ((got, host),) = reader.read(holder.contact())
    assert (got.pages, got.reason) == (PAGES, PeerReadOutcome.ALL)
    reader.check(0, host, 0, PAGES)


def test_head_sums_are_each_head_objects_k_then_v_and_refuse_pages_outside_the_pool(
        instances):
    holder = Holder("simulated", 2)
    instances.append(holder)
    cache = holder.caches[1]
    pages = cache.allocate_host(3)
    for i, page in enumerate(pages):
        holder.write(1, page, i)
    want = []
    for page in pages:
        for head in (1, 0):
            h = xxhash.xxh3_64()
            for part in (0, 1):
                h.update(cache.host_pool.page_head_view(page, head, part).numpy())
            want.append(h.intdigest())
    assert cache.exchange.l2_head_sums(pages, [1, 0]) == tuple(want)
    for pages, heads in (([cache.host_pool.num_pages], [0]), ([-1], [0]), ([0], [3])):
        with pytest.raises(CacheUsageError, match="outside the host pool"):
            cache.exchange.l2_head_sums(pages, heads)


def test_the_raw_baseline_moves_the_same_head_objects_once_its_start_time_came(instances):
    holder, reader = pair("simulated", 1, 3, instances)
    holder.fill()
    start = time.time() + 0.2
    for rank, (cache, peer) in enumerate(zip(reader.caches, reader.readers)):
        host = cache.allocate_host(PAGES)
        keys = cache.namespace.page_hashes(PROMPT[:PAGES * PAGE], PAGE, SALT)
        raw = peer.raw_read(holder.contact(), keys, host, start_at=start)
        assert time.time() >= start
        per_head = head_object_bytes(KVSpec(LAYERS, 1, DIM, PAGE, torch.float32))
        assert (raw.pages, raw.bytes) == (PAGES, PAGES * 2 * per_head * (HEADS // 3))
        assert raw.seconds > 0
        reader.check(rank, host, 0, PAGES)
