"""Cache event records, the router's prefix index and its choice."""
import collections
import random

import msgpack
import pytest

from kvtier.errors import ConfigError
from kvtier.keys import KeyNamespace
from kvtier.messages import MessageError
from kvtier.frontend.cache_events import (CacheEvent, CacheEventBatch, CacheEventKind,
                                          CacheEventLog, CacheTier)
from kvtier.frontend.router_index import (ApplyOutcome, ChoiceReason, PrefixIndex, Router,
                                          RouteWeights, TierHits)

NS = KeyNamespace("m")
PAGE = 4
STORED, DEMOTED, EVICTED = CacheEventKind.STORED, CacheEventKind.DEMOTED, CacheEventKind.EVICTED
DEVICE, HOST, STORAGE = CacheTier.DEVICE, CacheTier.HOST, CacheTier.STORAGE


def keys(tokens):
    return NS.page_hashes(tokens, PAGE)


class Feed:
    """One instance's producer side: its log and the router it publishes to."""

    def __init__(self, router, name):
        self.router, self.log = router, CacheEventLog(name)

    def send(self, kind, tier, hashes):
        self.log.record(kind, tier, hashes)
        batch = CacheEventBatch.from_msgpack(self.log.drain().to_msgpack())
        return self.router.apply(batch)


# ---- records -------------------------------------------------------------------------------

def test_batch_round_trips_and_carries_raw_digests():
    hashes = tuple(keys(range(40)))
    batch = CacheEventBatch("i0", 7, (CacheEvent(STORED, DEVICE, hashes),
                                      CacheEvent(DEMOTED, DEVICE, hashes[:2])))
    data = batch.to_msgpack()
    assert CacheEventBatch.from_msgpack(data) == batch
    assert len(data) < 12 * 32 + 128  # 32 bytes a page, not 66 as hex strings


@pytest.mark.parametrize("mutate", [
    lambda m: m.update(extra=1),
    lambda m: m.update(seq="1"),
    lambda m: m.update(seq=0),
    lambda m: m.update(instance=""),
    lambda m: m.update(type="StoredReport"),
    lambda m: m.pop("events"),
    lambda m: m["events"][0].update(kind="moved"),
    lambda m: m["events"][0].update(tier="l4"),
    lambda m: m["events"][0].update(pages=b"\x00" * 31),
    lambda m: m["events"][0].update(pages="ab" * 32),
    lambda m: m["events"][0].update(more=True),
    lambda m: m["events"][0].update(kind="demoted", tier="host"),
])
def test_bad_payloads_raise_message_error(mutate):
    batch = CacheEventBatch("i0", 1, (CacheEvent(STORED, HOST, tuple(keys(range(8)))),))
    data = msgpack.unpackb(batch.to_msgpack(), raw=False)
    mutate(data)
    with pytest.raises(MessageError):
        CacheEventBatch.from_msgpack(msgpack.packb(data, use_bin_type=True))


def test_bad_records_and_bytes_raise_message_error():
    with pytest.raises(MessageError):
        CacheEvent(STORED, DEVICE, ("XYZ",))
    with pytest.raises(MessageError):
        CacheEventBatch.from_msgpack(b"\xc1")
    with pytest.raises(MessageError):
        CacheEventBatch.from_msgpack("not bytes")


def test_log_coalesces_to_the_last_change_and_numbers_batches():
    log = CacheEventLog("i0")
    a, b = keys(range(8)), keys(range(100, 104))
    assert log.drain() is None
    log.record(STORED, DEVICE, a)
    log.record(STORED, DEVICE, b)
    log.record(DEMOTED, DEVICE, a)
    log.record(EVICTED, HOST, a)
    first = log.drain()
    assert first.seq == 1
    assert [(e.kind, e.tier, list(e.page_hashes)) for e in first.events] == [
        (STORED, DEVICE, b), (DEMOTED, DEVICE, a), (EVICTED, HOST, a)]
    log.record(STORED, STORAGE, b)
    assert log.drain().seq == 2 and log.drain() is None


def test_log_drops_the_oldest_changes_past_its_cap():
    log = CacheEventLog("i0", max_pending_pages=3)
    log.record(STORED, DEVICE, keys(range(20)))
    assert len(log) == 3 and log.dropped_pages == 2
    assert list(log.drain().events[0].page_hashes) == keys(range(20))[2:]


# ---- the index -----------------------------------------------------------------------------

def test_score_counts_the_contiguous_prefix_by_best_tier():
    router = Router()
    a, b = Feed(router, "a"), Feed(router, "b")
    doc = keys(range(40))  # 10 pages
    a.send(STORED, DEVICE, doc[:3])
    a.send(STORED, HOST, doc[:5])
    b.send(STORED, STORAGE, doc[:7])  # L3 is shared: a can hit it too
    a.send(STORED, DEVICE, doc[8:])  # after a hole: not part of the prefix
    assert router.index.score("a", doc) == TierHits(3, 2, 2)
    assert router.index.score("b", doc) == TierHits(0, 0, 7)
    assert router.index.score("nobody", doc) == TierHits(0, 0, 7)
    a.send(DEMOTED, DEVICE, doc[:3])
    assert router.index.score("a", doc) == TierHits(0, 5, 2)
    a.send(EVICTED, HOST, doc[:1])  # the first page is now only in L3
    assert router.index.score("a", doc) == TierHits(0, 4, 3)
    a.send(EVICTED, HOST, doc[1:5])
    assert router.index.score("a", doc) == TierHits(0, 0, 7)


def test_stale_and_out_of_order_batches_are_ignored_and_gaps_flagged():
    index = PrefixIndex()
    doc = tuple(keys(range(16)))
    stored = CacheEventBatch("a", 2, (CacheEvent(STORED, DEVICE, doc),))
    evicted = CacheEventBatch("a", 1, (CacheEvent(EVICTED, DEVICE, doc),))
    assert index.apply(stored) is ApplyOutcome.GAP  # batch 1 never arrived
    assert index.is_stale("a")
    assert index.apply(evicted) is ApplyOutcome.IGNORED  # older: must not undo batch 2
    assert index.apply(stored) is ApplyOutcome.IGNORED  # a duplicate
    assert index.score("a", doc) == TierHits(4, 0, 0)
    index.forget("a")
    assert not index.is_stale("a")
    assert index.apply(evicted) is ApplyOutcome.APPLIED
    assert index.score("a", doc) == TierHits(0, 0, 0)


def test_holdings_rebuild_a_new_routers_index_and_later_batches_follow_in_order():
    """An instance's server keeps an index of its own events; a router that starts again
    (or missed batches) restores that instance's entries from its holdings."""
    mirror, doc = Router(), keys(range(40))
    a = Feed(mirror, "a")
    assert mirror.index.holdings("a") is None  # nothing sent yet
    a.send(STORED, DEVICE, doc[:3])
    a.send(STORED, HOST, doc[:5])
    a.send(STORED, STORAGE, doc[:7])
    a.send(EVICTED, DEVICE, doc[2:3])
    held = CacheEventBatch.from_msgpack(mirror.index.holdings("a").to_msgpack())
    assert held.seq == 4
    fresh = PrefixIndex()
    fresh.apply(CacheEventBatch("a", 9, (CacheEvent(STORED, DEVICE, tuple(doc)),)))  # stale
    fresh.restore(held)
    assert not fresh.is_stale("a") and fresh.score("a", doc) == TierHits(2, 3, 2)
    log = a.log
    log.record(STORED, DEVICE, doc[2:4])
    assert fresh.apply(log.drain()) is ApplyOutcome.APPLIED  # seq 5: in order, no gap
    assert fresh.score("a", doc) == TierHits(4, 1, 2)


def test_memory_cap_drops_least_recently_changed_pages():
    index = PrefixIndex(max_pages_per_instance=50, max_storage_pages=20)
    for seq in range(1, 11):
        hashes = tuple(keys(range(seq * 1000, seq * 1000 + 40)))  # 10 pages
        index.apply(CacheEventBatch("a", seq, (CacheEvent(STORED, HOST, hashes),
                                               CacheEvent(STORED, STORAGE, hashes))))
        assert index.num_pages("a") <= 50 and index.num_storage_pages <= 20
    assert index.num_pages("a") == 50 and index.num_storage_pages == 20
    newest = keys(range(10_000, 10_040))
    assert index.score("a", newest) == TierHits(0, 10, 0)
    assert index.score("a", keys(range(1000, 1040))) == TierHits(0, 0, 0)


# ---- the router ----------------------------------------------------------------------------

def test_follow_up_turn_lands_on_the_instance_holding_its_prefix():
    router = Router()
    rng = random.Random(1)
    feeds = {name: Feed(router, name) for name in ("a", "b", "c")}
    turn1 = list(range(64))
    turn2 = turn1 + list(range(500, 532))  # the next turn extends the conversation
    for name, other in (("a", range(1000, 1064)), ("c", range(2000, 2064))):
        feeds[name].send(STORED, DEVICE, keys(other))
    feeds["b"].send(STORED, DEVICE, keys(turn1))
    choice = router.choose(keys(turn2), {"a": 0, "b": 1, "c": 0}, rng)
    assert choice.instance == "b" and choice.reason is ChoiceReason.BEST_HIT
    assert choice.hits == TierHits(16, 0, 0)


def test_load_spreads_when_every_instance_holds_the_prefix():
    router = Router()
    rng = random.Random(2)
    doc = keys(range(64))
    for name in ("a", "b", "c"):
        Feed(router, name).send(STORED, DEVICE, doc)
    loads = {"a": 0, "b": 0, "c": 0}
    picked = collections.Counter()
    running = collections.deque()
    for _ in range(100):
        choice = router.choose(doc, loads, rng)
        assert choice.reason in (ChoiceReason.TIE, ChoiceReason.BEST_HIT)
        picked[choice.instance] += 1
        loads[choice.instance] += 1
        running.append(choice.instance)
        if len(running) > 4:  # requests finish too, oldest first
            loads[running.popleft()] -= 1
    assert all(25 <= picked[name] <= 42 for name in loads), picked


def test_no_hit_anywhere_falls_back_to_two_choices():
    router = Router()
    rng = random.Random(3)
    loads = {"a": 5, "b": 0, "c": 9}
    picked = collections.Counter()
    for i in range(60):  # a new prefix each time (a routed one counts as held afterwards)
        choice = router.choose(keys(range(100 * i, 100 * i + 32)), loads, rng)
        assert choice.reason is ChoiceReason.NO_LOCAL_HIT
        picked[choice.instance] += 1
    assert picked["c"] == 0  # the most loaded never wins a pair
    assert picked["b"] > picked["a"] > 0


def test_l1_beats_l2_beats_l3_at_equal_load():
    router = Router()
    rng = random.Random(4)
    doc = keys(range(32))
    Feed(router, "l1").send(STORED, DEVICE, doc)
    Feed(router, "l2").send(STORED, HOST, doc)
    Feed(router, "l3").send(STORED, STORAGE, doc)  # every instance has L3 from here on
    loads = {"l1": 2, "l2": 2, "l3": 2}
    assert router.choose(doc, loads, rng).instance == "l1"
    del loads["l1"]
    choice = router.choose(doc, loads, rng)
    assert choice.instance == "l2" and choice.hits == TierHits(0, 8, 0)
    assert router.choose(doc, {"l3": 2, "other": 2}, rng).hits == TierHits(0, 0, 8)


def test_heavily_loaded_holder_loses_to_an_idle_instance_with_an_l3_hit():
    router = Router()
    rng = random.Random(5)
    doc = keys(range(32))
    holder, idle = Feed(router, "holder"), Feed(router, "idle")
    holder.send(STORED, DEVICE, doc)
    assert router.choose(doc, {"holder": 1, "idle": 0}, rng).instance == "holder"
    holder.send(STORED, STORAGE, doc)  # its backup to L3 is acknowledged
    choice = router.choose(doc, {"holder": 12, "idle": 0}, rng)
    assert choice.instance == "idle" and choice.hits == TierHits(0, 0, 8)


def test_with_peers_a_page_in_another_instances_l2_is_a_peer_hit():
    """Instances that read each other's L2: what one holds there (not only in L1) counts as
    a peer hit for the others, after L3; a busy holder loses to an idle peer reader."""
    doc = keys(range(32))
    for peers, expected in ((False, TierHits(0, 0, 0)), (True, TierHits(0, 0, 0, 8))):
        router = Router(peers=peers)
        holder = Feed(router, "holder")
        holder.send(STORED, HOST, doc)
        Feed(router, "only-l1").send(STORED, DEVICE, keys(range(100, 132)))
        assert router.index.score("idle", doc, peers) == expected
        choice = router.choose(doc, {"holder": 2, "idle": 0}, random.Random(6))
        assert choice.instance == ("idle" if peers else "holder"), choice
        # L1 alone is not readable by peers (only L2 is registered)
        assert router.index.score("idle", keys(range(100, 132)), peers) == TierHits(0, 0, 0)
    holder.send(STORED, STORAGE, doc[:2])  # in L3: storage first, then peers
    assert router.index.score("fresh", doc, True) == TierHits(0, 0, 2, 6)


def test_weights_are_validated():
    with pytest.raises(ConfigError):
        RouteWeights(host=2.0)
    with pytest.raises(ConfigError, match="peer"):
        RouteWeights(peer=0.1)
    with pytest.raises(ConfigError):
        RouteWeights(per_queued_request=-1)
    with pytest.raises(ConfigError):
        Router().choose(keys(range(8)), {}, random.Random(0))


def test_a_routed_prefix_counts_before_its_events_arrive():
    """The next turn of a conversation, sent before the instance's events reach the router,
    still goes where the first turn went."""
    router = Router(PrefixIndex())
    loads = {"a": 0, "b": 0}
    first = [f"{i:064x}" for i in range(6)]
    rng = random.Random(3)
    home = router.choose(first, loads, rng).instance
    for _ in range(20):
        follow_up = first + [f"{i:064x}" for i in range(100, 103)]
        choice = router.choose(follow_up, loads, rng)
        assert choice.instance == home and choice.hits.device_pages >= 6
