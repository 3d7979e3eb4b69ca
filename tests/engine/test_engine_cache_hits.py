"""The model over HierarchicalCache: hits from L1, L2 (loaded back layer by layer while the
model waits per layer) and L3 (another cache instance) equal a cold run bit for bit."""
from __future__ import annotations

import pytest
import torch
from cache_builder import build_cache
from eventually import eventually

from kvtier.config import HiCacheConfig
from kvtier.engine import ModelRunner, PagedLlama
from kvtier.tiers.hierarchical_cache import HierarchicalCache

PAGE = 16


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def serve(cache: HierarchicalCache, model: PagedLlama, prompt: list[int]):
    """One request the way a scheduler runs it: prefetch, lookup, allocate, prefill, finish."""
    ticket = cache.prefetch(prompt)
    if ticket is not None:
        eventually(lambda: cache.prefetch_ready(ticket), 30, "the prefetch was ready",
                   interval_s=0.001)
        cache.finish_prefetch(ticket)
    lookup = cache.lookup(prompt)
    fresh = cache.allocate(-(-len(prompt) // PAGE) - len(lookup.device_pages))
    assert fresh is not None
    pages = lookup.device_pages + fresh
    runner = ModelRunner(model, cache.device_pool, before_layer=cache.wait_layer)
    logits = runner.prefill(prompt, lookup.cached_len, pages)
    cache.finish(lookup, prompt, pages)
    return logits, lookup


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hits_from_every_tier_equal_a_cold_run(tiny_models, tmp_path, dtype) -> None:
    model = tiny_models[dtype]
    local = {"page_size": PAGE, "hicache_ratio": 4.0, "load_back_threshold_tokens": PAGE,
             "write_policy": "write_through"}
    config = HiCacheConfig.from_dict({
        **local, "storage_backend": "file", "storage_options": {"root_dir": str(tmp_path)},
        "prefetch_policy": "wait_complete", "prefetch_threshold_tokens": PAGE})
    doc = tokens(5 * PAGE, seed=1)
    first, second = doc + tokens(7, seed=2), doc + tokens(11, seed=3)
    spec = model.kv_spec(PAGE)
    with build_cache(spec, 24, HiCacheConfig.from_dict(local)) as cold_cache:
        cold, _ = serve(cold_cache, model, second)  # never saw `doc`
    with build_cache(spec, 24, config, model="tiny") as cache:
        serve(cache, model, first)
        l1, lookup = serve(cache, model, second)
        assert lookup.prefix_len == len(doc) and torch.equal(l1, cold)

        cache.flush()  # write-through copies land in L2
        cache.evict_device(cache.device_pool.num_pages)
        l2, lookup = serve(cache, model, second)
        assert lookup.prefix_len == 0 and lookup.host_loaded_length == len(doc)
        assert torch.equal(l2, cold)
        cache.flush()
        cache.storage.drain()  # L2 -> L3 backups land
    with build_cache(spec, 24, config, model="tiny") as other:
        l3, lookup = serve(other, model, second)
        assert lookup.host_loaded_length == len(doc) and torch.equal(l3, cold)
