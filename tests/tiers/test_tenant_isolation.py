"""Two tenants, one L3 directory: the tenant salt seeds the key chain and the namespace, so
1,000 probes by tenant B of prefixes tenant A cached hit nothing of A's in L1, L2 or L3,
while A's own probes hit. (Each tenant has its own caches: an instance serves one tenant.)"""
from __future__ import annotations

import random

import torch

from kvtier.config import HiCacheConfig
from kvtier.kv_spec import KVSpec
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.reference_kv import write_prefix_kv

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)


def make(root, tenant: str) -> HierarchicalCache:
    config = HiCacheConfig(page_size=4, hicache_ratio=2.0, prefetch_policy="wait_complete",
                           prefetch_threshold_tokens=4, load_back_threshold_tokens=4,
                           storage_backend="file", storage_options={"root_dir": str(root)})
    return HierarchicalCache(config, SPEC, 128, device="cpu", model="m", tenant_salt=tenant)


def store(cache: HierarchicalCache, tokens: list[int]) -> None:
    look = cache.lookup(tokens)
    fresh = cache.allocate(len(tokens) // 4 - len(look.device_pages))
    write_prefix_kv(cache.device_pool.kv, SPEC, tokens, fresh, first_page=len(look.device_pages))
    cache.finish(look, tokens, look.device_pages + fresh)


def probe(cache: HierarchicalCache, tokens: list[int]) -> tuple[int, int, int]:
    """Tokens the cache would reuse from L1, L2 and L3 for `tokens` (nothing is kept)."""
    ticket = cache.prefetch(tokens)
    storage = 0
    if ticket is not None:
        storage = ticket.storage_hit_pages * 4
        cache.abort_prefetch(ticket)
    look = cache.lookup(tokens)
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
