"""Pinned prefixes of one rank's cache: they survive L2 pressure, still hit, expire after their
TTL (an injected clock), a hit refreshes the TTL, unpin releases them, and the budget refuses
a pin that does not fit with the room it needs."""
import random

import pytest
import torch
from cache_builder import build_cache

from kvtier.kv_spec import KVSpec
from kvtier.policies import WritePolicy
from kvtier.tiers.cache_pins import PinOutcome, PinRefusal
from kvtier.tiers.reference_kv import prefix_kv_matches, write_prefix_kv

SPEC = KVSpec(num_layers=2, num_kv_heads=1, head_dim=4, page_size=4, dtype=torch.float32)
P = SPEC.page_size


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_cache(policy=WritePolicy.WRITE_THROUGH, device_pages=16, ratio=2.0):
    cache = build_cache(SPEC, device_pages, write_policy=policy, hicache_ratio=ratio,
                        load_back_threshold_tokens=0)
    cache.pins.clock = Clock()
    return cache


def serve(cache, tokens, salt=""):
    """Run one request's cache path (KV written as a reference pattern, hits checked)."""
    lookup = cache.lookup(tokens, salt=salt)
    need = -(-len(tokens) // P) - len(lookup.device_pages)
    fresh = cache.allocate(need)
    assert fresh is not None
    for layer in range(SPEC.num_layers):
        cache.wait_layer(layer)
    assert prefix_kv_matches(cache.device_pool.kv, SPEC, tokens[: lookup.cached_len],
                             lookup.device_pages)
    write_prefix_kv(cache.device_pool.kv, SPEC, tokens, fresh, first_page=len(lookup.device_pages))
    cache.finish(lookup, tokens, lookup.device_pages + fresh)
    cache.flush()
    return lookup


def flood(cache, rng, count=40):
    """Other prefixes, enough to cycle L1 and L2 several times over."""
    for _ in range(count):
        serve(cache, [rng.randrange(1000, 2000) for _ in range(6 * P)])


PINNED = list(range(1, 5 * P + 3))  # 5 whole pages and a partial one


def pin(cache, pin_id="p1", tokens=PINNED, ttl_s=60.0, fraction=0.5, salt=""):
    pages = cache.pins.held_pages(tokens, salt)
    return cache.pins.pin(pin_id, tokens, pages, ttl_s, fraction, salt=salt, tenant="t")


def test_a_pinned_prefix_survives_l2_pressure_and_still_hits():
    rng = random.Random(1)
    with make_cache() as cache:
        serve(cache, PINNED)
        out = pin(cache)
        assert isinstance(out, PinOutcome) and out.pages == 5 and out.host_pages == 5
        flood(cache, rng)
        assert cache.evict_host(cache.host_pool.num_pages).freed_pages > 0  # pressure ran
        cache.evict_device(cache.device_pool.num_pages)  # L1 may demote pinned pages
        assert cache.peek(PINNED).host_hit_length == 5 * P  # every pinned page still in L2
        again = serve(cache, PINNED)  # loaded back from L2 and checked byte for byte
        assert again.cached_len == 5 * P
        assert cache.pins.pinned_pages()[0] == 5


def test_without_the_pin_the_same_pressure_evicts_it():
    rng = random.Random(1)
    with make_cache() as cache:
        serve(cache, PINNED)
        flood(cache, rng)
        cache.evict_host(cache.host_pool.num_pages)
        assert cache.peek(PINNED).host_hit_length + cache.peek(PINNED).device_hit_length < 5 * P


def test_a_pin_expires_after_its_ttl_and_then_can_be_evicted():
    with make_cache() as cache:
        serve(cache, PINNED)
        pin(cache, ttl_s=10.0)
        clock = cache.pins.clock
        clock.now += 9.9
        assert cache.pins.expire() == []
        clock.now += 0.2
        assert cache.pins.expire() == ["p1"] and len(cache.pins) == 0
        cache.drop_unlocked()
        assert cache.peek(PINNED).host_hit_length == 0
        assert cache.tree.stats().host_protected_pages == 0


def test_a_hit_refreshes_the_ttl_a_miss_does_not():
    with make_cache() as cache:
        serve(cache, PINNED)
        pin(cache, ttl_s=10.0)
        clock = cache.pins.clock
        clock.now += 8.0
        serve(cache, [7777] * (3 * P))  # another prefix: no refresh
        assert cache.pins.take_refreshed() == []
        serve(cache, PINNED[: 2 * P] + [9] * P)  # uses the first two pinned pages
        assert cache.pins.take_refreshed() == ["p1"]
        clock.now += 8.0  # 16 s after the pin, 8 s after the hit
        assert cache.pins.expire() == []
        assert cache.pins.describe()[0].expires_in_s == pytest.approx(2.0)
        clock.now += 2.5
        assert cache.pins.expire() == ["p1"]


def test_unpin_releases_the_pages_to_eviction():
    with make_cache() as cache:
        serve(cache, PINNED)
        pin(cache)
        assert cache.pins.pinned_pages()[0] == 5
        assert cache.pins.unpin("p1") and not cache.pins.unpin("p1")
        cache.drop_unlocked()
        assert cache.peek(PINNED).host_hit_length == 0
        assert cache.audit().leaked_locks == 0


def test_a_pin_over_the_l2_share_is_refused_with_the_missing_room():
    with make_cache(ratio=2.0) as cache:  # 32 L2 pages; 25% = 8 for pins
        serve(cache, PINNED)
        other = list(range(500, 500 + 4 * P))
        serve(cache, other)
        assert isinstance(pin(cache, fraction=0.25), PinOutcome)  # 5 pages
        refused = pin(cache, "p2", tokens=other, fraction=0.25)
        assert refused == PinRefusal(4, 3, refused.reason) and "L2" in refused.reason
        assert len(cache.pins) == 1
        # overlapping pins count shared pages once: a pin of the first 3 pinned pages fits
        assert isinstance(pin(cache, "p3", tokens=PINNED[: 3 * P], fraction=0.25), PinOutcome)
        assert cache.pins.pinned_pages()[0] == 5


def test_pinning_again_refreshes_and_l1_only_runs_get_an_l2_copy():
    with make_cache(policy=WritePolicy.WRITE_BACK) as cache:  # nothing reaches L2 by itself
        serve(cache, PINNED)
        assert cache.used_host_pages == 0
        out = pin(cache, ttl_s=5.0)
        assert out.host_pages == 5 and cache.used_host_pages == 5
        cache.pins.clock.now += 4.0
        assert pin(cache, ttl_s=5.0).expires_in_s == 5.0
        cache.pins.clock.now += 4.0
        assert cache.pins.expire() == []


def test_salted_pins_stay_with_their_salt():
    with make_cache() as cache:
        serve(cache, PINNED, salt="tenant-a")
        assert cache.pins.held_pages(PINNED, "") == 0
        assert isinstance(pin(cache, salt="tenant-a"), PinOutcome)
        serve(cache, PINNED)  # the unsalted prefix is another one: no refresh
        assert cache.pins.take_refreshed() == []
