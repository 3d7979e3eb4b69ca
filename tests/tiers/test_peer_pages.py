"""Peer-to-peer L2 in one process (tiers/peer_pages): a reader instance's ranks read a prompt's
pages from a holder instance's L2 over a real one-sided READ (simulated, NIXL, Mooncake), with
each side at its own TP size; what arrives is the holder's bytes, head by head, or nothing of
a page: a page the holder overwrote after lending it, a holder that lacks pages, a dead
holder or endpoint cut the result short and never raise."""
from __future__ import annotations

import dataclasses
import sys
import threading
import time

import numpy as np
import pytest
import torch
from cache_builder import build_cache

from kvtier.backends.handoff_base import HandoffTimeout, HandoffUnavailable
from kvtier.backends.handoff_registry import open_endpoint
from kvtier.errors import ConfigError
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.messages import PeerContact, PeerRank
from kvtier.tiers.page_exchange import head_object_bytes
from kvtier.tiers.peer_pages import (PeerLender, PeerReader,
                                     PeerReadOutcome)

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

    def __init__(self, kind: str, tp: int, role: str):
        spec = KVSpec(LAYERS, HEADS // tp, DIM, PAGE, torch.float32)
        self.tp = tp
        self.caches = [build_cache(spec, 16, model="tiny", tp_rank=r, tp_size=tp)
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

    def __init__(self, kind: str, tp: int):
        super().__init__(kind, tp, "holder")
        self.lenders = [PeerLender(c, e, self.heads(r))
                        for r, (c, e) in enumerate(zip(self.caches, self.endpoints))]
        self.asked: list[tuple] = []

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
        ranks = tuple(PeerRank(r, self.tp, h.start, h.stop, f"lender-{r}", "peers")
                      for r, h in enumerate(map(self.heads, range(self.tp))))
        return PeerContact("ns", "holder-0", ranks)

    def ask(self, rank: PeerRank, tokens, salt, first_page, num_pages, heads):
        self.asked.append((rank.rank, first_page, num_pages, heads))
        return self.lenders[rank.rank].lend(tokens, salt, first_page, num_pages, heads)


class Reader(Instance):
    def __init__(self, kind: str, tp: int, ask):
        super().__init__(kind, tp, "reader")
        self.readers = [PeerReader(c, e, self.heads(r), ask, TIMEOUT_S)
                        for r, (c, e) in enumerate(zip(self.caches, self.endpoints))]

    def read(self, contact: PeerContact, first_page: int = 0, pages: int = PAGES):
        """Every rank's read of PROMPT's pages first_page.. into fresh L2 pages:
        [(result, host pages)] by rank."""
        out = []
        for cache, reader in zip(self.caches, self.readers):
            host = cache.allocate_host(pages)
            out.append((reader.read_into(contact, PROMPT, SALT, first_page, host), host))
        return out

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
            except HandoffUnavailable as exc:
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


def pair(kind: str, holder_tp: int, reader_tp: int, instances, ask=None):
    holder = Holder(kind, holder_tp)
    instances.append(holder)
    reader = Reader(kind, reader_tp, ask or holder.ask)
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
    # each reader rank asked only the holder ranks with its heads, for just those heads
    assert sorted(h for _, _, _, heads in holder.asked for h in heads) == list(range(HEADS))
    assert all(n == want and first == first_page for _, first, n, _ in holder.asked)


@pytest.mark.parametrize("kind, holder_tp, reader_tp",
                         cases([(1, 1), (3, 1), (1, 3)], [(1, 1)]), indirect=["kind"])
def test_a_page_overwritten_after_it_was_lent_ends_the_read_before_it(kind, instances,
                                                                       holder_tp, reader_tp):
    """The holder evicted page 3 and reused its L2 page between the ask and the read: the
    read sees other bytes under the old sums and keeps only pages 0..2 (never wrong bytes)."""
    holder = Holder(kind, holder_tp)
    instances.append(holder)

    def ask_then_reuse(rank, *args):  # other bytes after each lend: each rank sees a change
        lend = holder.ask(rank, *args)
        holder.write(rank.rank, lend.host_pages[3], 3, version=len(holder.asked))
        return lend

    reader = Reader(kind, reader_tp, ask_then_reuse)
    instances.append(reader)
    holder.fill()
    for rank, (got, host) in enumerate(reader.read(holder.contact())):
        assert (got.pages, got.reason) == (3, PeerReadOutcome.SUM_MISMATCH)
        reader.check(rank, host, 0, 3)
        assert reader.readers[rank].counters.mismatches == 1


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
def test_a_holder_endpoint_gone_after_the_lend_is_a_failed_read(kind, instances):
    """The holder's endpoint closes between its lend and the read (the instance going
    away): the read fails, nothing is kept; asked again, the holder cannot lend at all."""
    holder = Holder(kind, 1)
    instances.append(holder)

    def ask_then_close(rank, *args):
        lend = holder.ask(rank, *args)
        holder.endpoints[rank.rank].close()
        return lend

    reader = Reader(kind, 1, ask_then_close)
    instances.append(reader)
    holder.fill()
    ((got, _),) = reader.read(holder.contact())
    assert (got.pages, got.reason) == (0, PeerReadOutcome.TRANSPORT_FAILED)
    ((got, _),) = reader.read(holder.contact())
    assert (got.pages, got.reason) == (0, PeerReadOutcome.ASK_FAILED)
    assert reader.readers[0].counters[:5] == (2, 0, 0, 2, 0)


def test_a_dead_holder_rank_or_a_lend_that_does_not_fit_is_a_failed_ask(instances):
    def dead(rank, *args):
        raise ConnectionError(f"the actor {rank.actor} died")

    holder = Holder("simulated", 3)
    instances.append(holder)
    reader = Reader("simulated", 1, dead)
    instances.append(reader)
    holder.fill()
    ((got, _),) = reader.read(holder.contact())
    assert (got.pages, got.bytes, got.reason) == (0, 0, PeerReadOutcome.ASK_FAILED)

    def too_many(rank, *args):  # sums for fewer heads than asked
        lend = holder.ask(rank, *args)
        return dataclasses.replace(lend, sums=lend.sums[1:])

    reader.readers[0].ask = too_many
    ((got, _),) = reader.read(holder.contact())
    assert (got.pages, got.reason) == (0, PeerReadOutcome.ASK_FAILED)
    assert reader.readers[0].counters[:5] == (2, 0, 0, 2, 0)


def test_a_timed_out_read_says_so(instances):
    """The transport may still write the reader's pages after a timeout: the reason tells."""
    holder, reader = pair("simulated", 1, 1, instances)
    holder.fill()

    def hung(*args):
        raise HandoffTimeout("the peer did not answer in 10 s")

    reader.endpoints[0].read = hung
    ((got, _),) = reader.read(holder.contact())
    assert (got.pages, got.reason) == (0, PeerReadOutcome.TRANSPORT_TIMEOUT)


def test_holder_ranks_that_miss_some_heads_are_not_asked(instances):
    holder, reader = pair("simulated", 3, 1, instances)
    holder.fill()
    partial = holder.contact()
    partial = PeerContact(partial.namespace, partial.holder, partial.ranks[:2])
    ((got, _),) = reader.read(partial)
    assert (got.pages, got.reason) == (0, PeerReadOutcome.NO_HEADS) and not holder.asked
    ((got, _),) = reader.read(holder.contact(), pages=0)
    assert (got.pages, got.reason) == (0, PeerReadOutcome.ALL) and not holder.asked


def test_a_lend_counts_no_hit_and_skips_copies_still_in_flight(instances):
    """A run whose L1->L2 copy has not been seen landing is not lent; once it has, it is.
    Lending touches no LRU stamp or hit count and locks nothing."""
    holder = Holder("simulated", 1)
    instances.append(holder)
    cache, lender = holder.caches[0], holder.lenders[0]
    tokens = PROMPT[:4 * PAGE]
    lookup = cache.lookup(tokens, salt=SALT)
    pages = cache.allocate(4)
    cache.finish(lookup, tokens, pages)  # write-through: the L1->L2 copy starts
    assert cache.copies
    assert lender.lend(tokens, SALT, 0, 4, range(HEADS)).host_pages == ()
    cache.flush()
    nodes = cache.tree.nodes()
    before = [(n.hit_count, n.last_access, n.lock_ref, n.host_ref) for n in nodes]
    lend = lender.lend(PROMPT, SALT, 1, 5, [4, 0])
    assert len(lend.host_pages) == 3 and len(lend.sums) == 3 * 2  # pages 1..3, 2 heads each
    assert (lend.pool_heads, lend.address) == (HEADS, holder.endpoints[0].address())
    assert [(n.hit_count, n.last_access, n.lock_ref, n.host_ref) for n in nodes] == before
    assert lender.lend(PROMPT, "other salt", 0, 4, [0]).host_pages == ()


def test_a_lender_refuses_heads_it_does_not_hold(instances):
    holder = Holder("simulated", 3)
    instances.append(holder)
    holder.fill()
    with pytest.raises(ConfigError, match="not one of this rank's"):
        holder.lenders[1].lend(PROMPT, SALT, 0, 2, [3, 4])
    assert holder.lenders[1].lend(PROMPT, SALT, 0, 2, [3, 2]).sums


def test_a_page_is_summed_once_however_often_it_is_lent(instances, monkeypatch):
    """A popular prefix is lent to many peers: the holder sums each page once."""
    holder = Holder("simulated", 1)
    instances.append(holder)
    holder.fill()
    cache, lender = holder.caches[0], holder.lenders[0]
    summed = []
    real = cache.exchange.l2_head_sums
    monkeypatch.setattr(type(cache.exchange), "l2_head_sums",
                        lambda self, pages, heads: summed.append(list(pages)) or real(pages,
                                                                                       heads))
    first = lender.lend(PROMPT, SALT, 0, PAGES, range(HEADS))
    again = lender.lend(PROMPT, SALT, 2, 3, [1, 0])
    assert len(summed) == 1 and len(summed[0]) == PAGES
    assert again.host_pages == first.host_pages[2:5]
    assert again.sums == tuple(first.sums[p * HEADS + h] for p in range(2, 5) for h in (1, 0))


def test_a_lend_waits_for_a_cache_call_in_progress_and_nothing_else(instances):
    """A lend runs on a thread of its own beside the cache's owner: it waits while the owner
    is inside a cache call (holding the guard), and answers as soon as it leaves."""
    holder = Holder("simulated", 1)
    instances.append(holder)
    holder.fill()
    cache, lender = holder.caches[0], holder.lenders[0]
    got: list = []
    lending = threading.Thread(target=lambda: got.append(
        lender.lend(PROMPT, SALT, 0, PAGES, range(HEADS))))
    with cache.guard:  # the owner in the middle of a cache call
        lending.start()
        lending.join(0.3)
        assert lending.is_alive() and not got  # blocked on the guard, not done
    lending.join(10)
    assert len(got) == 1 and len(got[0].host_pages) == PAGES


def test_lends_beside_an_owner_that_keeps_reusing_l2_never_deliver_wrong_bytes(instances,
                                                                               monkeypatch):
    """The owner evicts the prompt's L2 pages and writes them again into other L2 pages
    (other bytes each round: a recomputed prompt), while a reader asks and reads on another
    thread: every page a read keeps holds the prompt's page of one round, head by head.
    (A lend that read the tree without the cache's guard failed this: it summed a page the
    owner had meanwhile given to another page of the prompt, and the read kept it.)"""
    holder, reader = pair("simulated", 1, 1, instances)
    holder.fill()
    cache, pool = holder.caches[0], reader.caches[0].host_pool
    rounds, stop = 60, threading.Event()
    sums = cache.exchange.l2_head_sums

    def slow_sums(pages, heads):  # as summing tens of MB takes: the owner moves on
        time.sleep(0.002)
        return sums(pages, heads)

    monkeypatch.setattr(cache.exchange, "l2_head_sums", slow_sums)

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
                for i, page in enumerate(host):  # outside the guard, as a copy lands
                    views = [holder.caches[0].host_pool.page_head_view(page, h, part)
                             for h in range(HEADS) for part in (0, 1)]
                    for view, obj in zip(views, objects[version, i]):
                        view.copy_(obj)
                with cache.guard:
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
