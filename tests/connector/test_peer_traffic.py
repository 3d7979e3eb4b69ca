"""Peer-to-peer L2 between the connector's workers, without vLLM: engine B's ranks read the
pages engine A's ranks hold in their host pools, over the real transports (in one process),
across TP sizes, and a page A rewrites or an A gone is a miss, never wrong bytes."""
from __future__ import annotations

import time
from typing import NamedTuple

import pytest
import torch
import xxhash

from kvtier.backends.transport_base import TransportUnavailable
from kvtier.backends.transport_registry import open_endpoint
from kvtier.connector.peer_traffic import HostPeerPool, PeerTraffic
from kvtier.connector.plan import PageFetch, PageLoad, PageSave, StepPlan, WorkerReport
from kvtier.connector.worker_side import WorkerSide
from kvtier.errors import CacheUsageError
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import HeadRange
from kvtier.messages import PeerContact
from kvtier.tiers.peer_pages import PeerLender, PeerReader

NS = KeyNamespace("m", layout_fingerprint="vllm")
LAYERS, BLOCKS, HEADS, BS, HD = 2, 8, 2, 4, 8  # 2 KV heads: TP 1 and 2
SLOTS = 6
KEYS = NS.page_hashes(list(range(40)), BS)  # 10 pages
TIMEOUT_S = 5.0


def kv_caches(seed: int, heads: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout, `heads` KV heads (a rank's share), random bytes."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(LAYERS, BLOCKS, heads, BS, 2 * HD, generator=gen).to(torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in range(LAYERS)}


class Settled(NamedTuple):
    fetched: list[int]
    failed_fetches: set[int]


class Engine:
    """An engine of `tp` ranks: a WorkerSide each (its blocks seeded with `seed`), lending
    its host pool and reading peers' over an endpoint of `kind`."""

    def __init__(self, kind: str, tp: int, name: str, seed: int):
        self.tp, self.name = tp, name
        self.heads = [HeadRange.of_rank(HEADS, r, tp) for r in range(tp)]
        self.caches = [kv_caches(seed + r, h.count) for r, h in enumerate(self.heads)]
        self.workers = [WorkerSide(c, SLOTS, block_size=BS) for c in self.caches]
        self.endpoints, self.lenders = [], []
        try:
            for r, w in enumerate(self.workers):
                endpoint = open_endpoint(kind, f"{name}-{r}")
                self.endpoints.append(endpoint)
                self.lenders.append(PeerLender(w.peer_pool, endpoint, self.heads[r], w.lend))
                w.attach_peers(PeerTraffic(PeerReader(w.peer_pool, endpoint, self.heads[r],
                                                      TIMEOUT_S)))
        except TransportUnavailable as exc:
            self.close()
            pytest.skip(str(exc))

    def contact(self) -> PeerContact:
        return PeerContact("ns", self.name, tuple(
            lender.contact(r, self.tp, f"{self.name}-{r}") for r, lender in
            enumerate(self.lenders)))

    def step(self, plan: StepPlan) -> WorkerReport:
        out = None
        for w in self.workers:
            w.begin_step(plan)
            report = w.end_step(plan)
            out = report if out is None else out.merge(report)
        return out

    def settled(self, count: int) -> "Settled":
        """Steps until every rank finished `count` fetches (bounded): the slots read, one
        entry per rank, and the slots some rank failed."""
        fetched: list[int] = []
        failed: set[int] = set()
        deadline = time.monotonic() + 30
        while len(fetched) + len(failed) < count * self.tp:
            assert time.monotonic() < deadline, "the peer reads did not finish"
            for w in self.workers:
                report = w.end_step(StepPlan())
                fetched += [t.slot for t in report.fetched]
                failed |= {t.slot for t in report.failed_fetches}
            time.sleep(0.01)
        return Settled(fetched, failed)

    def head(self, global_head: int, slot: int) -> torch.Tensor:
        """Head `global_head`'s K and V of `slot`, over the layers, from the rank holding it."""
        for h, w in zip(self.heads, self.workers):
            if h.start <= global_head < h.stop:
                return w.host[slot, global_head - h.start].clone()
        raise AssertionError(global_head)

    def close(self):
        for w in self.workers:
            w.close()
        for lender in self.lenders:
            lender.close()
        for endpoint in self.endpoints:
            endpoint.close()


@pytest.fixture(params=["nixl", "mooncake"])
def kind(request):
    return request.param


@pytest.mark.parametrize("tp_a,tp_b", [(1, 1), (1, 2), (2, 1)])
def test_a_peers_pages_land_with_its_bytes_across_tp_sizes(kind, tp_a, tp_b):
    a = Engine(kind, tp_a, "a", 0)
    b = Engine(kind, tp_b, "b", 10)
    try:
        a.step(StepPlan(saves=(PageSave((1, 2, 3), (4, 0, 2), tuple(KEYS[:3])),)))
        report = b.step(StepPlan(fetches=(PageFetch(tuple(KEYS[:3]), (1, 2, 3), 1, a.contact()),)))
        got = b.settled(3)
        assert sorted(got.fetched) == sorted([1, 2, 3] * tp_b) and not got.failed_fetches
        assert not report.failed_fetches
        for theirs, ours in ((4, 1), (0, 2), (2, 3)):
            for head in range(HEADS):
                assert torch.equal(b.head(head, ours), a.head(head, theirs))
        # what B read is listed for its own peers, with the sums its read checked (none
        # left over), and A reads it back into other slots: those sums are the bytes'
        assert all(len(w.peer_pool.sums) == 0 for w in b.workers)
        a.step(StepPlan(fetches=(PageFetch(tuple(KEYS[:3]), (1, 3, 5), 1, b.contact()),)))
        assert sorted(a.settled(3).fetched) == sorted([1, 3, 5] * tp_a)
        assert all(torch.equal(a.head(h, 5), a.head(h, 2)) for h in range(HEADS))
    finally:
        b.close()
        a.close()


def test_a_slot_the_holder_rewrote_after_the_lookup_is_a_miss(kind):
    """B looks A's pages up, then A saves other pages into two of those slots before B's
    read: B keeps the pages before the first rewritten one and reports the rest failed."""
    a = Engine(kind, 1, "a", 0)
    b = Engine(kind, 1, "b", 10)
    try:
        a.step(StepPlan(saves=(PageSave((1, 2, 3, 4), (0, 1, 2, 3), tuple(KEYS[:4])),)))
        reader = b.workers[0].peers.reader
        looked = reader.lookup_fn

        def rewrite_then_read(rank, keys, heads):
            lend = looked(rank, keys, heads)
            # A's scheduler evicted pages 2 and 3 and saved others into their slots
            a.step(StepPlan(saves=(PageSave((6, 7), (2, 3), tuple(KEYS[6:8])),)))
            return lend

        reader.lookup_fn = rewrite_then_read
        b.step(StepPlan(fetches=(PageFetch(tuple(KEYS[:4]), (5, 4, 3, 2), 1, a.contact()),)))
        got = b.settled(4)
        assert sorted(got.fetched) == [4, 5] and got.failed_fetches == {2, 3}
        assert torch.equal(b.head(0, 5), a.head(0, 0)) and torch.equal(b.head(1, 4), a.head(1, 1))
        # A's table lists the new pages where the old were: a fresh read of them finds 2
        reader.lookup_fn = looked
        b.step(StepPlan(fetches=(PageFetch(tuple(KEYS[:4]), (0, 1, 2, 3), 1, a.contact()),)))
        got = b.settled(4)
        assert sorted(got.fetched) == [0, 1] and got.failed_fetches == {2, 3}
    finally:
        b.close()
        a.close()


def test_a_holder_gone_is_a_failed_read_and_loads_count_peer_tokens(kind):
    a = Engine(kind, 1, "a", 0)
    b = Engine(kind, 1, "b", 10)
    try:
        a.step(StepPlan(saves=(PageSave((1, 2), (0, 1), tuple(KEYS[:2])),)))
        contact = a.contact()
        b.step(StepPlan(fetches=(PageFetch(tuple(KEYS[:2]), (0, 1), 1, contact),)))
        assert sorted(b.settled(2).fetched) == [0, 1]
        b.step(StepPlan(loads=(PageLoad("r", (0, 1), (5, 6), from_peer=2),)))
        assert b.workers[0].take_stats().peer_hit_tokens == 2 * BS
        a.close()
        b.step(StepPlan(fetches=(PageFetch(tuple(KEYS[:2]), (2, 3), 1, contact),)))
        got = b.settled(2)
        assert not got.fetched and got.failed_fetches == {2, 3}
    finally:
        b.close()


def test_a_slot_being_rewritten_is_unlisted_until_its_save_lands():
    """The table: a save clears the slot's row before it copies and lists it after, with the
    sums of the bytes it holds then."""
    from kvtier.tiers.peer_table import PeerTable, lookup

    w = WorkerSide(kv_caches(0, HEADS), SLOTS, block_size=BS)
    table = PeerTable(SLOTS, HEADS)
    w.lend(table)
    w.end_step(StepPlan(saves=(PageSave((1,), (3,), (KEYS[0],)),)))
    raw = table.rows.view("u1")
    hit = lookup(raw, HEADS, KEYS[:1])
    assert hit.pages == (3,) and hit.sums == HostPeerPool(w.host).head_sums([3], [0, 1])
    w.end_step(StepPlan(saves=(PageSave((2,), (3,), (KEYS[5],)),)))
    assert lookup(table.rows.view("u1"), HEADS, KEYS[:1]).pages == ()
    assert lookup(table.rows.view("u1"), HEADS, KEYS[5:6]).pages == (3,)
    w.lend(None)  # lending stopped: saves list nothing
    w.end_step(StepPlan(saves=(PageSave((3,), (4,), (KEYS[6],)),)))
    assert lookup(table.rows.view("u1"), HEADS, KEYS[6:7]).pages == ()


def test_a_host_pools_head_sums_are_each_slot_heads_bytes_and_refuse_other_slots():
    host = torch.randn(SLOTS, HEADS, 2, LAYERS, BS * HD).to(torch.bfloat16)
    pool = HostPeerPool(host)
    want = tuple(xxhash.xxh3_64_intdigest(host[s, h].contiguous().view(torch.uint8).numpy())
                 for s in (4, 1) for h in (1, 0))
    assert pool.head_sums([4, 1], [1, 0]) == want
    for slots, heads in (([SLOTS], [0]), ([-1], [0]), ([0], [HEADS])):
        with pytest.raises(CacheUsageError, match="outside the host pool"):
            pool.head_sums(slots, heads)
