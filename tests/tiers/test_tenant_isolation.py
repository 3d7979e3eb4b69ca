"""Tenants never hit each other's prefixes, in L1, L2 or L3.

Two ways to separate them: a deployment's tenant salt (the namespace: each tenant has its own
caches), and a request's cache salt (one cache serves several tenants; each salt has its own
root in the tree and its own key chain in the namespace). 1,000 probes each."""
from __future__ import annotations

import random

import torch
from cache_builder import build_cache

from kvtier.kv_spec import KVSpec
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.reference_kv import write_prefix_kv

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)


def make(root, tenant: str) -> HierarchicalCache:
    return build_cache(SPEC, 128, tenant_salt=tenant, hicache_ratio=2.0,
                       prefetch_policy="wait_complete", prefetch_threshold_tokens=4,
                       load_back_threshold_tokens=4, storage_backend="file",
                       storage_options={"root_dir": str(root)})


def store(cache: HierarchicalCache, tokens: list[int], salt: str = "") -> None:
    look = cache.lookup(tokens, salt=salt)
    fresh = cache.allocate(len(tokens) // 4 - len(look.device_pages))
    write_prefix_kv(cache.device_pool.kv, SPEC, tokens, fresh, first_page=len(look.device_pages))
    cache.finish(look, tokens, look.device_pages + fresh)


def probe(cache: HierarchicalCache, tokens: list[int], salt: str = "") -> tuple[int, int, int]:
    """Tokens the cache would reuse from L1, L2 and L3 for `tokens` (nothing is kept)."""
    ticket = cache.prefetch(tokens, salt=salt)
    storage = 0
    if ticket is not None:
        storage = ticket.storage_hit_pages * 4
        cache.abort_prefetch(ticket)
    look = cache.lookup(tokens, salt=salt)
    hits = (look.prefix_len, look.host_hit_length, storage)
    cache.abort(look)
    return hits


def test_a_thousand_cross_tenant_probes_hit_nothing(tmp_path):
    rng = random.Random(1)
    docs = [[rng.randrange(1, 5000) for _ in range(32)] for _ in range(12)]
    a = make(tmp_path, "tenant-a")
    for doc in docs:
        store(a, doc)
    a.flush()
    a.storage.drain()  # A's pages are in L1, L2 and L3
    b = make(tmp_path, "tenant-b")
    try:
        assert a.namespace != b.namespace
        for i in range(1000):
            doc = docs[i % len(docs)]
            cut = 4 * rng.randrange(1, len(doc) // 4 + 1)
            prompt = doc[:cut] + [rng.randrange(1, 5000) for _ in range(rng.randrange(1, 9))]
            assert probe(b, prompt) == (0, 0, 0), (i, prompt)
            if i % 10 == 0:  # the same prompt from B's side reaches A's cache, never B's
                assert sum(probe(a, prompt)) > 0
        assert b.storage.counters.storage_hit_tokens == 0
        a2 = make(tmp_path, "tenant-a")  # A's pages are in L3: A's next instance hits them
        try:
            assert probe(a2, docs[0] + [7])[2] == 32
        finally:
            a2.close()
    finally:
        a.close()
        b.close()


def test_a_thousand_cross_salt_probes_in_one_cache_hit_nothing(tmp_path):
    """One cache (one deployment), three cache salts: A's documents are cached in L1, in L2
    only (L1 dropped) and in L3; probes with salt B or unsalted hit none of them, A's hit."""
    rng = random.Random(2)
    docs = [[rng.randrange(1, 5000) for _ in range(32)] for _ in range(12)]
    cache = make(tmp_path, "deployment")
    try:
        for doc in docs:
            store(cache, doc, salt="tenant-a")
        cache.flush()
        cache.storage.drain()
        cache.drop_unlocked()  # every document in L3 only
        for doc in docs[:6]:
            store(cache, doc, salt="tenant-a")
        cache.flush()
        cache.evict_device(cache.device_pages)  # documents 0-5 in L2 only
        for doc in docs[:3]:
            store(cache, doc, salt="tenant-a")  # documents 0-2 in L1 again
        assert [p[0] > 0 for p in (probe(cache, d, "tenant-a") for d in docs[:4])] == \
            [True, True, True, False]
        for i in range(1000):
            doc = docs[i % len(docs)]
            cut = 4 * rng.randrange(1, len(doc) // 4 + 1)
            prompt = doc[:cut] + [rng.randrange(1, 5000) for _ in range(rng.randrange(1, 9))]
            for other in ("tenant-b", ""):
                assert probe(cache, prompt, other) == (0, 0, 0), (i, other, prompt)
            if i % 10 == 0:
                assert sum(probe(cache, prompt, "tenant-a")) >= cut, (i, prompt)
        assert cache.storage.counters.storage_hit_tokens > 0  # A's probes reached L3
        assert cache.tree.num_salts == 1  # B's and unsalted probes left no root behind
    finally:
        cache.close()
    other = make(tmp_path, "deployment")  # the next instance: A's L3 pages are A's only
    try:
        assert probe(other, docs[0] + [7], "tenant-a")[2] == 32
        assert probe(other, docs[0] + [7], "tenant-b") == (0, 0, 0)
        assert probe(other, docs[0] + [7]) == (0, 0, 0)
    finally:
        other.close()


def test_a_salt_keys_its_pages_with_a_chain_of_its_own():
    from kvtier.keys import KeyNamespace

    ns = KeyNamespace("m", "t", "f")
    tokens = list(range(16))
    plain, a, b = (ns.page_hashes(tokens, 4, s) for s in ("", "a", "b"))
    assert plain == ns.page_hashes(tokens, 4) and len({*plain, *a, *b}) == 12


def test_salted_roots_go_with_their_last_page(tmp_path):
    cache = make(tmp_path, "deployment")
    try:
        store(cache, list(range(1, 17)), salt="x")
        store(cache, list(range(1, 17)))
        assert cache.tree.num_salts == 1
        cache.flush()
        cache.storage.drain()
        cache.drop_unlocked()
        assert cache.tree.num_salts == 0 and cache.tree.nodes() == []
        assert cache.audit() == (0, 0, 0, 0, 0, 0), cache.audit()
    finally:
        cache.close()
