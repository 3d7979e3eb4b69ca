"""A hybrid model's sliding-window KV through L1 and L2: hits need their trailing window, a
request keeps at most two windows of it, and every hit's window holds exactly the bytes a
recomputation writes."""
from __future__ import annotations

import random

import pytest
import torch
from cache_builder import build_cache

from kvtier.kv_spec import KVSpec, SlidingSpec
from kvtier.policies import MemLayout, WritePolicy
from kvtier.tiers.reference_kv import prefix_kv_matches, write_prefix_kv

PAGE = 4
SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, page_size=PAGE, dtype=torch.float32,
              sliding=SlidingSpec(num_layers=2, window=9))  # a window of 2 pages
WINDOW_PAGES = SPEC.window_pages
CHUNK = 8


def make_cache(policy=WritePolicy.WRITE_THROUGH, layout=MemLayout.PAGE_FIRST, device_pages=64,
               ratio=3.0):
    return build_cache(SPEC, device_pages, write_policy=policy, mem_layout=layout,
                       hicache_ratio=ratio, load_back_threshold_tokens=PAGE)


def _sidecar_kv(cache):
    return cache.device_pool.sidecar.slots.kv


def usable_pages(cache, lookup, num_tokens: int) -> int:
    """The longest usable hit (pages): leaves a token to compute, has its trailing window."""
    limit = min(len(lookup.device_pages), (num_tokens - 1) // PAGE)
    return next(m for m in range(limit, -1, -1)
                if cache.sliding.window_ok(lookup.device_pages, m))


def serve(cache, tokens, stats=None):
    """One request as the engine runs it: hit, trim, then chunked compute with prepare/prune."""
    sk, side = cache.sliding, cache.device_pool.sidecar
    lookup = cache.lookup(tokens)
    for layer in range(SPEC.num_layers):
        cache.wait_layer(layer)
    m = usable_pages(cache, lookup, len(tokens))
    hit_pages = lookup.device_pages[:m]
    # every page of the hit has its full KV, and its trailing window its sliding KV
    assert prefix_kv_matches(cache.device_pool.kv, SPEC, tokens[:m * PAGE], hit_pages)
    window = hit_pages[max(0, m - WINDOW_PAGES):]
    for i, page in enumerate(window):
        pos = (m - len(window) + i)
        expect = torch.empty_like(_sidecar_kv(cache)[:, :, :1])
        write_prefix_kv(expect, SPEC.sidecar, tokens, [0], first_page=pos)
        assert torch.equal(_sidecar_kv(cache)[:, :, side.slot(page)], expect[:, :, 0]), \
            "a hit's window holds sliding KV that differs from recompute"
    sk.trim_hit(lookup.sliding, lookup.device_pages, m)
    total = -(-len(tokens) // PAGE)
    fresh = cache.allocate(total - m)
    assert fresh is not None
    table = hit_pages + fresh
    pos = m * PAGE
    while pos < len(tokens):
        stop = min(len(tokens), pos + CHUNK)
        sk.prepare(lookup.sliding, table, pos, stop)
        first, last = pos // PAGE, -(-stop // PAGE)
        write_prefix_kv(cache.device_pool.kv, SPEC, tokens, table[first:last], first_page=first)
        write_prefix_kv(_sidecar_kv(cache), SPEC.sidecar, tokens,
                        [side.slot(p) for p in table[first:last]], first_page=first)
        pos = stop
        sk.prune(lookup.sliding, table, m, pos, len(tokens))
        if stats is not None:
            stats.append(len(lookup.sliding))
    cache.finish(lookup, tokens, table)
    return m


@pytest.mark.parametrize("policy", list(WritePolicy))
@pytest.mark.parametrize("layout", [MemLayout.PAGE_FIRST, MemLayout.LAYER_FIRST])
def test_hits_from_l1_and_l2_carry_their_window_and_nothing_leaks(policy, layout):
    rng = random.Random(f"{policy}-{layout}")
    docs = [[rng.randrange(50) for _ in range(rng.randrange(8, 60))] for _ in range(5)]
    held, hits, sent = [], 0, []
    with make_cache(policy, layout) as cache:
        for i in range(50):
            if sent and rng.random() < 0.4:  # a resent prompt (a retry, the next turn's start)
                tokens = rng.choice(sent)
            else:
                tokens = rng.choice(docs) + [rng.randrange(50) for _ in range(rng.randrange(9))]
            sent.append(tokens)
            hits += serve(cache, tokens, held) > 0
            if i % 7 == 6:
                cache.flush()
                cache.evict_device(cache.device_pool.num_pages)  # the next hits come from L2
        assert hits >= 10 and cache.sliding.loaded_to_device > 0
        assert max(held) <= 2 * WINDOW_PAGES + CHUNK // PAGE + 2
        cache.flush()
        for side in (cache.device_pool.sidecar, cache.host_pool.sidecar):
            assert side.audit() == (0, 0)  # no slot without a page, none locked
        cache.drop_unlocked()
        assert cache.device_pool.sidecar.used_slots == 0
        assert cache.host_pool.sidecar.used_slots == 0


def test_a_resent_prompt_hits_at_its_end_and_long_prompts_keep_two_windows():
    with make_cache() as cache:
        for length in (40, 120):
            tokens = [length + t for t in range(length)]  # no shared prefix
            before = cache.device_pool.sidecar.used_slots
            assert serve(cache, tokens) == 0
            kept = cache.device_pool.sidecar.used_slots - before
            assert kept <= 2 * WINDOW_PAGES + 1  # bounded by the window, not by the length
            assert serve(cache, tokens) == (length - 1) // PAGE


def test_a_hit_whose_window_lost_its_sliding_kv_is_shortened_to_where_it_has_it():
    with make_cache() as cache:
        tokens = list(range(1, 41))  # 10 pages
        serve(cache, tokens)
        lookup = cache.lookup(tokens)
        assert usable_pages(cache, lookup, len(tokens)) == 9
        side = cache.device_pool.sidecar
        side.unlock(list(lookup.sliding.pages))
        lookup.sliding.pages.clear()
        side.release([lookup.device_pages[7]])  # inside the trailing window of 9 pages
        shortened = usable_pages(cache, lookup, len(tokens))
        assert shortened < 9  # pages 7 and 8 were its window: it ends before page 7 now...
        assert shortened == 0 or cache.sliding.window_ok(lookup.device_pages, shortened)
        assert not cache.sliding.window_ok(lookup.device_pages, 8)  # ...or where it still has
        cache.abort(lookup)


def test_a_pin_keeps_the_sliding_kv_of_its_window_in_l2():
    with make_cache() as cache:
        tokens = list(range(1, 41))  # 10 pages
        serve(cache, tokens)
        cache.flush()
        host = cache.host_pool.sidecar
        pages = 9  # the whole pages a resend hits
        assert cache.pins.pin("p", tokens, pages, ttl_s=60.0, max_fraction=1.0).pages == pages
        host.evict(host.slots.num_pages)  # pressure: every cached L2 slot goes...
        cache.evict_device(cache.device_pool.num_pages)
        lookup = cache.lookup(tokens)  # ...but the pinned window loads back from L2
        for layer in range(SPEC.num_layers):
            cache.wait_layer(layer)
        assert usable_pages(cache, lookup, len(tokens)) == pages
        cache.abort(lookup)
        assert cache.pins.unpin("p")
        assert host.locked_slots == 0
