"""The connector's scheduler half and its L2 index, without vLLM: hits, plans, the MIN rule."""
from __future__ import annotations

import pytest

from kvtier.connector.l2_index import L2Index
from kvtier.connector.plan import PageStore, Ticket, WorkerReport
from kvtier.connector.scheduler_side import ScheduledRequest, SchedulerSide
from kvtier.keys import KeyNamespace, PageInputs

BS = 4
NS = KeyNamespace("m", layout_fingerprint="f")


def side(slots: int = 16, tp: int = 1) -> SchedulerSide:
    return SchedulerSide(NS, BS, slots, tp)


def run_prefill(s: SchedulerSide, req: str, tokens: list[int], blocks: list[int],
                ranks: int = 1, local: int = 0) -> tuple:
    """A request computed in one step from `local` tokens on; returns (plan, hit tokens)."""
    s.add(req)
    hit = s.match(req, tokens, local)
    s.allocated(req, blocks, hit)
    plan = s.plan([ScheduledRequest(req, tokens, blocks, len(tokens))])
    saved = frozenset(slot for save in plan.saves for slot in save.slots)
    s.settle(WorkerReport(ranks=ranks, saved=saved))
    return plan, hit


def test_saved_pages_hit_the_next_request_and_keep_one_token():
    s = side()
    tokens = list(range(100, 117))  # 17 tokens: 4 full pages
    plan, hit = run_prefill(s, "a", tokens, [10, 11, 12, 13, 14])
    assert hit == 0 and [save.blocks for save in plan.saves] == [(10, 11, 12, 13)]
    s.finish("a")
    plan, hit = run_prefill(s, "b", tokens, [20, 21, 22, 23, 24])
    assert hit == 16
    (load,) = plan.loads
    assert load.blocks == (20, 21, 22, 23) and plan.saves == ()
    # a prompt of exactly 16 tokens: the last page is recomputed, never loaded
    plan, hit = run_prefill(s, "c", tokens[:16], [30, 31, 32, 33])
    assert hit == 12 and plan.loads[0].blocks == (30, 31, 32)


def test_vllm_local_hit_is_skipped_and_salt_separates():
    s = side()
    tokens = list(range(17))
    run_prefill(s, "a", tokens, [1, 2, 3, 4, 5])
    s.add("b")
    assert s.match("b", tokens, local_tokens=8) == 8  # pages 2, 3 from L2
    s.allocated("b", [6, 7, 8, 9, 10], 8)
    assert s.plan([]).loads[0].blocks == (8, 9)
    s.add("salted", PageInputs("tenant-x"))
    assert s.match("salted", tokens, 0) == 0


def test_a_page_counts_only_when_every_rank_saved_it():
    s = side(tp=2)
    tokens = list(range(9))
    run_prefill(s, "a", tokens, [1, 2, 3], ranks=1)  # one rank's report: not held
    s.add("b")
    assert s.match("b", tokens, 0) == 0
    one = WorkerReport(saved=frozenset({5}))
    other = WorkerReport(saved=frozenset(), failed_saves=frozenset({5}))
    merged = one.merge(other)
    assert merged.ranks == 2 and merged.saved == frozenset() and 5 in merged.failed_saves


def test_generated_blocks_are_saved_as_they_fill():
    s = side()
    tokens = list(range(6))
    s.add("a")
    s.allocated("a", [1, 2], s.match("a", tokens, 0))
    assert s.plan([ScheduledRequest("a", tokens, [1, 2], 6)]).saves[0].blocks == (1,)
    tokens += [6, 7]  # two decode steps fill page 1
    assert s.plan([ScheduledRequest("a", tokens[:7], [1, 2], 7)]).saves == ()
    assert s.plan([ScheduledRequest("a", tokens, [1, 2], 8)]).saves[0].blocks == (2,)


def test_failed_load_forgets_the_page():
    s = side()
    tokens = list(range(9))
    run_prefill(s, "a", tokens, [1, 2, 3])
    s.add("b")
    assert s.match("b", tokens, 0) == 8
    slots = s.index.held_run(s._keys(s._requests["b"], tokens, 2))
    s.settle(WorkerReport(failed_loads=frozenset(slots[1:])))
    assert s.match("b", tokens, 0) == 4 and s.counts.failed_loads == 1


def test_index_evicts_least_recent_deepest_first_and_never_saving_pages():
    idx = L2Index(3)
    slots = idx.reserve(["a", "b", "c"])
    assert idx.reserve(["d"]) == []  # every slot is being saved
    idx.settle(slots, [])
    idx.touch(slots)  # a, b, c used together: c (the deepest) goes first
    (d,) = idx.reserve(["d"])
    assert d == slots[2] and "c" not in idx and idx.held_run(["a", "b"]) == slots[:2]
    with pytest.raises(ValueError):
        idx.reserve(["a"])


class FakeDirectory:
    """The namespace directory as the scheduler side sees it, over a set of published keys."""

    def __init__(self, published: list[str]) -> None:
        self.published = list(published)
        self.leases: list[str] = []
        self.missing: list[str] = []

    def lookup(self, keys):
        hit = 0
        while hit < len(keys) and keys[hit] in self.published:
            hit += 1
        lease = f"lease-{len(self.leases)}" if hit else ""
        if lease:
            self.leases.append(lease)
        return hit, lease

    def release(self, lease_id):
        self.leases.remove(lease_id)

    def report_missing(self, keys):
        self.missing += keys
        self.published = [k for k in self.published if k not in keys]


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def l3_side(published_tokens: list[int], policy: str = "wait_complete", tp: int = 1):
    from kvtier.config import HiCacheConfig

    directory = FakeDirectory(NS.page_hashes(published_tokens, BS))
    clock = Clock()
    config = HiCacheConfig(prefetch_policy=policy, prefetch_timeout_base_s=1.0,
                           prefetch_timeout_max_s=5.0)
    return SchedulerSide(NS, BS, 16, tp, directory, config, clock), directory, clock


def test_pages_in_l3_are_fetched_into_l2_then_hit():
    tokens = list(range(17))
    s, directory, _ = l3_side(tokens, tp=2)
    s.add("a")
    assert s.match("a", tokens, 0) is None  # fetching: ask again
    (fetch,) = s.plan([]).fetches
    assert fetch.keys == tuple(NS.page_hashes(tokens, BS)) and len(directory.leases) == 1
    s.settle(WorkerReport(ranks=2, fetched=fetch.tickets()))  # rank 0 read all four
    assert s.match("a", tokens, 0) is None  # rank 1 has not: not a hit yet
    s.settle(WorkerReport(ranks=2, fetched=fetch.tickets()))
    assert s.match("a", tokens, 0) == 16 and directory.leases == []
    assert s.counts.fetched_pages == 4


def test_a_failed_fetch_is_reported_missing_and_computed():
    tokens = list(range(13))
    s, directory, _ = l3_side(tokens)
    s.add("a")
    assert s.match("a", tokens, 0) is None
    (fetch,) = s.plan([]).fetches
    s.settle(WorkerReport(fetched=fetch.tickets()[:1], failed_fetches=fetch.tickets()[1:]))
    assert directory.missing == list(fetch.keys[1:]) and directory.leases == []
    assert s.match("a", tokens, 0) == 4  # the page read; the rest is not asked for again
    assert s.plan([]).fetches == ()


def test_the_prefetch_policy_bounds_the_wait():
    tokens = list(range(13))
    for policy, waits in (("best_effort", False), ("timeout", True)):
        s, _, clock = l3_side(tokens, policy)
        s.add("a")
        first = s.match("a", tokens, 0)
        assert (first is None) == waits
        clock.now = 10.0  # past the timeout: what L2 holds now
        assert s.match("a", tokens, 0) == 0


def test_with_l3_saved_pages_are_written_and_kept_until_every_rank_wrote_them():
    s, _, _ = l3_side([], tp=2)
    s.index = L2Index(2, ranks=2)  # two slots: a third page needs one evicted
    tokens = list(range(9))
    s.add("a")
    s.allocated("a", [1, 2, 3], s.match("a", tokens, 0))
    (save,) = s.plan([ScheduledRequest("a", tokens, [1, 2, 3], 9)]).saves
    s.settle(WorkerReport(ranks=2, saved=frozenset(save.slots[:1]),
                          failed_saves=frozenset(save.slots[1:])))  # one rank failed one
    (store,) = s.plan([]).stores  # written only once every rank saved it
    assert store == PageStore((NS.page_hashes(tokens, BS)[0],), save.slots[:1])
    assert s.plan([]).stores == ()
    (slot,) = store.slots
    assert s.index.reserve(["new"]) != [slot]  # the failed slot was free; this one is kept
    assert s.index.reserve(["newer"]) == []  # being written to L3
    s.settle(WorkerReport(ranks=2, stored=(slot,)))
    assert s.index.reserve(["newest"]) == []  # one rank wrote it: not yet
    s.settle(WorkerReport(ranks=2, stored=(slot,)))
    assert s.index.reserve(["newest"]) == [slot]  # written by both ranks: evictable


def test_the_router_learns_pages_held_evicted_and_stored_with_their_tokens():
    """`take_changes`: a page is HELD once every rank saved it (with its tokens, parent key
    and salt, from which the router keys it), EVICTED when its slot is reused, STORED once
    every rank wrote it to L3, and not STORED when a rank gave up."""
    from kvtier.connector.l2_index import L2ChangeKind, PageOrigin

    s, _, _ = l3_side([], tp=2)
    s.index = L2Index(3, ranks=2)
    tokens = list(range(9))
    s.add("a", PageInputs("t"))
    s.allocated("a", [1, 2, 3], s.match("a", tokens, 0))
    (save,) = s.plan([ScheduledRequest("a", tokens, [1, 2, 3], 9)]).saves
    assert s.take_changes() == []  # saving: not a hit yet
    s.settle(WorkerReport(ranks=2, saved=frozenset(save.slots)))
    keys = NS.page_hashes(tokens, BS, salt="t")
    assert s.take_changes() == [
        (L2ChangeKind.HELD, keys[0], PageOrigin((0, 1, 2, 3), None, "t")),
        (L2ChangeKind.HELD, keys[1], PageOrigin((4, 5, 6, 7), keys[0], "t"))]
    (store,) = s.plan([]).stores
    first, second = store.slots
    s.settle(WorkerReport(ranks=2, stored=(first, second), failed_stores=frozenset({second})))
    s.settle(WorkerReport(ranks=2, stored=(first, second)))
    assert s.take_changes() == [
        (L2ChangeKind.STORED, keys[0], PageOrigin((0, 1, 2, 3), None, "t"))]
    s.index.reserve(["x", "y"])  # one slot free: the least recently written page goes
    assert [(c.kind, c.key) for c in s.take_changes()] == [(L2ChangeKind.EVICTED, keys[0])]
    assert all(e.origin is None for e in s.index._entries.values())  # nothing kept for them


def test_write_through_selective_saves_a_page_once_a_second_request_used_it():
    """SGLang's write_through_selective: a page computed once stays in vLLM's blocks only; the
    second request that uses it (a hit in vLLM's prefix cache here) saves it from its own
    blocks, and the third finds it in L2."""
    from kvtier.config import HiCacheConfig

    s = SchedulerSide(NS, BS, 16, config=HiCacheConfig(page_size=BS,
                                                       write_policy="write_through_selective"))
    tokens = list(range(200, 213))  # 13 tokens: 3 full pages
    plan, hit = run_prefill(s, "a", tokens, [1, 2, 3, 4])
    assert hit == 0 and plan.saves == ()  # used once: not saved
    s.finish("a")
    plan, hit = run_prefill(s, "b", tokens, [1, 2, 3, 9], local=8)  # vLLM's own hit: 2 pages
    assert hit == 0  # nothing in L2 yet
    assert [save.blocks for save in plan.saves] == [(1, 2, 3)]  # used twice: saved now
    s.finish("b")
    plan, hit = run_prefill(s, "c", tokens, [5, 6, 7, 8])
    assert hit == 12 and plan.saves == ()
    # a page used once more than the others: only the hot run is saved
    longer = tokens + list(range(300, 304))  # page 3 (tokens 12..15) used for the first time
    plan, _ = run_prefill(s, "d", longer, [5, 6, 7, 10, 11], local=12)
    assert plan.saves == ()


class FakePeers:
    """Another engine listing `held` keys in its L2 (the directory's best_peer)."""

    def __init__(self, held: list[str]):
        from kvtier.messages import PeerContact

        self.held = held
        self.contact = PeerContact("ns", "engine-a")
        self.asked: list[list[str]] = []

    def best_peer(self, keys):
        self.asked.append(list(keys))
        run = 0
        while run < len(keys) and keys[run] in self.held:
            run += 1
        return run, self.contact if run else None


def peer_side(held_tokens: list[int], published_tokens: list[int] | None = None,
              tp: int = 1):
    from kvtier.config import HiCacheConfig

    peers = FakePeers(NS.page_hashes(held_tokens, BS))
    directory = None if published_tokens is None else FakeDirectory(
        NS.page_hashes(published_tokens, BS))
    config = HiCacheConfig(prefetch_policy="wait_complete", prefetch_timeout_max_s=5.0)
    return SchedulerSide(NS, BS, 16, tp, directory, config, Clock(), peers), peers, directory


def test_pages_a_peer_holds_are_read_from_it_and_hit_as_peer_tokens():
    tokens = list(range(17))
    s, peers, _ = peer_side(tokens, tp=2)  # L3 off
    s.add("a")
    assert s.match("a", tokens, 0) is None  # reading from the peer: ask again
    (fetch,) = s.plan([]).fetches
    assert fetch.peer is peers.contact and fetch.first_page == 0
    assert fetch.keys == tuple(NS.page_hashes(tokens, BS))
    s.settle(WorkerReport(ranks=2, fetched=fetch.tickets()))
    s.settle(WorkerReport(ranks=2, fetched=fetch.tickets()))  # every rank read them
    assert s.match("a", tokens, 0) == 16
    s.allocated("a", [1, 2, 3, 4, 5], 16)
    (load,) = s.plan([]).loads
    assert (load.from_l3, load.from_peer) == (0, 4)
    assert s.supplied("a") == (0, 0, 16, 0)
    assert s.counts.peer_hit_tokens == 16 and s.counts.peer_hit_pages == 4
    # loaded once: the pages are L2's own from now on
    s.add("b")
    s.allocated("b", [6, 7, 8, 9, 10], s.match("b", tokens, 0))
    assert s.supplied("b") == (16, 0, 0, 0)


def test_a_peer_is_read_only_past_what_l3_has_and_a_failed_read_is_not_reported_missing():
    tokens = list(range(17))
    s, peers, directory = peer_side(tokens[:9], published_tokens=tokens)  # L3 has more
    s.add("a")
    assert s.match("a", tokens, 0) is None
    (fetch,) = s.plan([]).fetches
    assert fetch.peer is None and len(fetch.keys) == 4  # from L3
    s2, peers2, directory2 = peer_side(tokens, published_tokens=tokens[:5])  # the peer more
    s2.add("a")
    assert s2.match("a", tokens, 0) is None
    (fetch,) = s2.plan([]).fetches
    assert fetch.peer is peers2.contact and len(fetch.keys) == 4
    assert directory2.leases == []  # L3's lease given back at once
    s2.settle(WorkerReport(fetched=fetch.tickets()[:2], failed_fetches=fetch.tickets()[2:]))
    assert directory2.missing == []  # the peer's pages are no L3 objects
    assert s2.match("a", tokens, 0) == 8


def test_page_saves_carry_their_keys():
    s = side()
    tokens = list(range(9))
    plan, _ = run_prefill(s, "a", tokens, [1, 2, 3])
    (save,) = plan.saves
    assert save.keys == tuple(NS.page_hashes(tokens, BS)[:2])


def fill(s: SchedulerSide, first_token: int, blocks: int) -> set[int]:
    """A cold request of `blocks` full pages saved into L2: the slots it was given."""
    tokens = list(range(first_token, first_token + blocks * BS + 1))
    plan, _ = run_prefill(s, f"fill-{first_token}", tokens, list(range(blocks + 1)))
    return {slot for save in plan.saves for slot in save.slots}


def test_a_slot_one_rank_failed_is_not_reused_while_the_other_still_reads_it():
    """TP 2: rank 0 fails a fetch while rank 1 still reads it. The page is a miss from then
    on, but its slot is handed to nothing until rank 1 reported too; rank 1's late 'read' then
    frees it (no hit of bytes only one rank has), and a report of that old fetch on the
    slot's next fetch changes nothing."""
    tokens = list(range(100, 109))  # 2 pages in L3
    s, directory, _ = l3_side(tokens, tp=2)
    s.index = L2Index(4, 2)  # a small pool: reuse shows at once
    s.add("a")
    assert s.match("a", tokens, 0) is None
    (fetch,) = s.plan([]).fetches
    s.settle(WorkerReport(ranks=2, failed_fetches=fetch.tickets()))  # rank 0 gave up
    assert s.match("a", tokens, 0) == 0 and directory.missing == list(fetch.keys)
    assert directory.leases  # rank 1 still reads the objects: the lease stays
    # the pool fills up with other pages: the two slots rank 1 writes are never among them
    others = fill(s, 1000, 3)
    assert others.isdisjoint(fetch.slots) and len(others) == 2
    s.settle(WorkerReport(ranks=2, fetched=fetch.tickets()))  # rank 1 read them, late
    assert s.match("a", tokens, 0) == 0 and directory.leases == []  # no hit: rank 0 lacks them
    reused = fill(s, 2000, 4)
    assert set(fetch.slots) <= reused  # free again once every rank was done with them
    # an engine reading them again: a new fetch, a new generation; the old one's report on
    # the same slots counts for nothing
    directory.published = list(fetch.keys)
    s.add("b")
    assert s.match("b", tokens, 0) is None
    (again,) = s.plan([]).fetches
    stale = tuple(Ticket(slot, fetch.gen) for slot in again.slots)
    assert again.gen != fetch.gen
    s.settle(WorkerReport(ranks=2, fetched=stale + stale))
    assert s.match("b", tokens, 0) is None and s.counts.stale_reports == 4
    s.settle(WorkerReport(ranks=2, fetched=again.tickets() + again.tickets()))
    assert s.match("b", tokens, 0) == 8


def test_a_slot_a_rank_may_still_write_stays_reserved_until_its_call_returns():
    tokens = list(range(100, 105))  # 1 page in L3
    s, directory, _ = l3_side(tokens, tp=2)
    s.index = L2Index(2, 2)
    s.add("a")
    assert s.match("a", tokens, 0) is None
    (fetch,) = s.plan([]).fetches
    s.settle(WorkerReport(ranks=2, fetched=fetch.tickets(), held_fetches=fetch.tickets()))
    assert s.match("a", tokens, 0) == 0  # a miss at once: the request computes it
    assert s.index.quarantined == 1
    assert fill(s, 1000, 3).isdisjoint(fetch.slots)  # every rank reported, one still writes
    s.settle(WorkerReport(ranks=2, released=fetch.tickets()))
    assert set(fetch.slots) <= fill(s, 2000, 3) and s.index.quarantined == 0


def test_pinned_pages_are_not_evicted_until_unpinned():
    idx = L2Index(2)
    slots = idx.reserve(["a", "b"])
    idx.settle(slots, [])
    idx.pin(slots[:1])
    assert idx.reserve(["c"]) == [slots[1]]  # "a" is older but pinned
    assert idx.reserve(["d"]) == []
    idx.unpin(slots[:1])
    assert idx.reserve(["d"]) == [slots[0]]


def test_a_preempted_requests_pages_stay_in_l2_until_it_is_admitted_again():
    s = side(slots=3)
    tokens = list(range(500, 513))  # 3 full pages
    run_prefill(s, "victim", tokens, [1, 2, 3, 4])
    s.keep("victim", tokens)  # pushed back for a hit
    assert fill(s, 2000, 2) == set()  # a cold request finds nothing to evict
    s.add("victim-again")  # (vLLM keeps the id; a second request of the same text here)
    assert s.match("victim-again", tokens, 0) == 12
    s.allocated("victim", [5, 6, 7, 8], 0)  # admitted: its pages may go again
    assert len(fill(s, 3000, 2)) == 2


def test_a_load_that_failed_is_not_reported_as_supplied():
    """vLLM counts every token it planned to take from the connector as cached; the request's
    report says which of them failed to load (vLLM computed them again)."""
    from kvtier.vllm_engine.cached import CachedBySource

    s = side()
    tokens = list(range(17))
    run_prefill(s, "a", tokens, [1, 2, 3, 4, 5])
    s.add("b")
    s.allocated("b", [6, 7, 8, 9, 10], s.match("b", tokens, 0))
    (load,) = s.plan([]).loads
    s.settle(WorkerReport(failed_loads=frozenset(load.slots[2:])))
    got = s.supplied("b")
    assert got == CachedBySource(16, 0, 0, 8) and got.loaded() == CachedBySource(8, 0, 0)
    assert CachedBySource.of(got.to_params()) == got
    assert CachedBySource(4, 8, 4, 6).loaded() == CachedBySource(0, 6, 4)
