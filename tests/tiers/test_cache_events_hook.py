"""The cache's event hook: every tier change is told with the request's own chain keys."""
import random

import torch
from cache_builder import build_cache

from kvtier.kv_spec import KVSpec
from kvtier.policies import PrefetchPolicy, WritePolicy
from kvtier.frontend.cache_events import CacheEventBatch, CacheEventKind, CacheEventLog, CacheTier
from kvtier.tiers.reference_kv import write_prefix_kv

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
STORED, DEMOTED, EVICTED = CacheEventKind.STORED, CacheEventKind.DEMOTED, CacheEventKind.EVICTED
DEVICE, HOST, STORAGE = CacheTier.DEVICE, CacheTier.HOST, CacheTier.STORAGE


def make(policy=WritePolicy.WRITE_THROUGH, seed=None, device_pages=32):
    sim = {} if seed is None else {"storage_backend": "simulated",
                                   "storage_options": {"seed": seed}}
    return build_cache(SPEC, device_pages, write_policy=policy, hicache_ratio=2.0,
                       prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, prefetch_threshold_tokens=4,
                       load_back_threshold_tokens=4, storage_batch_pages=3, **sim)


class Recorder:
    def __init__(self, cache):
        self.events = []
        cache.set_event_listener(lambda kind, tier, hashes: self.events.append((kind, tier, list(hashes))))

    def take(self):
        out, self.events = self.events, []
        return out

    def pages(self, kind, tier, events=None):
        return [h for k, t, hs in (events if events is not None else self.events)
                if (k, t) == (kind, tier) for h in hs]


def prefill(cache, tokens):
    ticket = cache.prefetch(tokens)
    if ticket is not None:
        while not cache.prefetch_ready(ticket):
            ticket.op._settled.wait(0.01)
        cache.finish_prefetch(ticket)
    lookup = cache.lookup(tokens)
    fresh = cache.allocate(-(-len(tokens) // 4) - len(lookup.device_pages))
    for layer in range(SPEC.num_layers):
        cache.wait_layer(layer)
    write_prefix_kv(cache.device_pool.kv, SPEC, tokens, fresh, first_page=len(lookup.device_pages))
    cache.finish(lookup, tokens, lookup.device_pages + fresh)


def settle(cache):
    cache.flush()
    if cache.storage is not None:
        cache.storage.drain()
    cache.flush()


def test_no_listener_means_no_tree_hook():
    with make() as cache:
        assert cache.tree.listener is None
        rec = Recorder(cache)
        assert cache.tree.listener is not None
        cache.set_event_listener(None)
        assert cache.tree.listener is None
        prefill(cache, list(range(12)))
        assert rec.events == []


def test_prefill_demote_evict_and_backup_tell_the_request_page_hashes():
    doc = list(range(100, 142))  # 10 full pages and a partial one (no key)
    with make(seed=random.getrandbits(48)) as cache:
        rec = Recorder(cache)
        keys = cache.namespace.page_hashes(doc, 4)
        assert len(keys) == 10
        prefill(cache, doc)
        assert rec.take() == [(STORED, DEVICE, keys)]  # the copy to L2 has not landed yet
        settle(cache)
        events = rec.take()
        assert rec.pages(STORED, HOST, events) == keys
        assert sorted(rec.pages(STORED, STORAGE, events)) == sorted(keys)
        assert {(k, t) for k, t, _ in events} == {(STORED, HOST), (STORED, STORAGE)}

        cache.evict_device(10_000)  # an L1 flush: the L2 copies stay
        assert rec.take() == [(DEMOTED, DEVICE, keys)]
        cache.tree.evict_host(10_000)
        events = rec.take()
        assert {(k, t) for k, t, _ in events} == {(EVICTED, HOST)}
        assert sorted(rec.pages(EVICTED, HOST, events)) == sorted(keys)


def test_follow_up_turn_tells_only_its_new_pages():
    with make() as cache:
        rec = Recorder(cache)
        first = list(range(16))
        prefill(cache, first)
        rec.take()
        follow = first + list(range(50, 58))
        prefill(cache, follow)
        assert rec.take() == [(STORED, DEVICE, cache.namespace.page_hashes(follow, 4)[4:])]


def test_l1_only_run_is_evicted_and_write_back_copies_before_demoting():
    with make(WritePolicy.WRITE_THROUGH_SELECTIVE) as cache:  # one hit: no L2 copy yet
        rec = Recorder(cache)
        doc = list(range(20))
        prefill(cache, doc)
        rec.take()
        cache.evict_device(10_000)
        assert rec.take() == [(EVICTED, DEVICE, cache.namespace.page_hashes(doc, 4))]
    with make(WritePolicy.WRITE_BACK) as cache:
        rec = Recorder(cache)
        doc = list(range(20))
        prefill(cache, doc)
        rec.take()
        cache.evict_device(10_000)
        keys = cache.namespace.page_hashes(doc, 4)
        assert rec.take() == [(STORED, HOST, keys), (DEMOTED, DEVICE, keys)]


def test_l2_hit_loaded_back_is_stored_in_l1_again():
    with make() as cache:
        rec = Recorder(cache)
        doc = list(range(24))
        prefill(cache, doc)
        settle(cache)
        cache.evict_device(10_000)
        rec.take()
        prefill(cache, doc)
        assert rec.pages(STORED, DEVICE, rec.take()) == cache.namespace.page_hashes(doc, 4)


def test_prefetch_from_l3_is_stored_in_l2_of_the_reader():
    seed = random.getrandbits(48)
    doc = list(range(200, 232))
    with make(seed=seed) as writer:
        prefill(writer, doc)
        settle(writer)
    with make(seed=seed) as reader:
        rec = Recorder(reader)
        prefill(reader, doc + [1, 2])
        keys = reader.namespace.page_hashes(doc, 4)
        events = rec.take()
        assert rec.pages(STORED, HOST, events)[: len(keys)] == keys  # landed from L3
        assert rec.pages(STORED, DEVICE, events) == keys  # then loaded back for the prefill


def test_event_log_turns_the_hook_into_a_batch_for_the_router():
    with make(seed=random.getrandbits(48)) as cache:
        log = CacheEventLog("instance-0")
        cache.set_event_listener(log.record)
        doc = list(range(300, 332))
        prefill(cache, doc)
        settle(cache)
        cache.evict_device(10_000)
        batch = CacheEventBatch.from_msgpack(log.drain().to_msgpack())
        keys = cache.namespace.page_hashes(doc, 4)
        by_kind = {}
        for e in batch.events:
            by_kind.setdefault((e.kind, e.tier), []).extend(e.page_hashes)
        # STORED in L1 was overtaken by DEMOTED; L2 and L3 keep their STORED
        assert set(by_kind) == {(STORED, HOST), (DEMOTED, DEVICE), (STORED, STORAGE)}
        for pages in by_kind.values():
            assert sorted(pages) == sorted(keys)
        assert log.drain() is None
