"""The facade end to end: random requests through L1/L2, every hit checked byte for byte."""
import random

import pytest
import torch
from cache_builder import build_cache

from kvtier.config import HiCacheConfig
from kvtier.errors import CacheUsageError
from kvtier.kv_spec import KVSpec
from kvtier.policies import IoBackend, MemLayout, WritePolicy
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.reference_kv import prefix_kv_matches, write_prefix_kv

SPEC = KVSpec(num_layers=3, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)


def make_cache(policy=WritePolicy.WRITE_THROUGH, layout=MemLayout.PAGE_FIRST,
               io=IoBackend.KERNEL, device_pages=24, ratio=3.0, threshold=4):
    return build_cache(SPEC, device_pages, write_policy=policy, mem_layout=layout,
                       io_backend=io, hicache_ratio=ratio, load_back_threshold_tokens=threshold)


def serve(cache, tokens):
    lookup = cache.lookup(tokens)
    need = -(-len(tokens) // SPEC.page_size) - len(lookup.device_pages)
    fresh = cache.allocate(need)
    if fresh is None:
        cache.abort(lookup)
        return None
    for layer in range(SPEC.num_layers):
        cache.wait_layer(layer)
    assert prefix_kv_matches(cache.device_pool.kv, SPEC, tokens[: lookup.cached_len],
                             lookup.device_pages), "a hit returned KV that differs from recompute"
    write_prefix_kv(cache.device_pool.kv, SPEC, tokens, fresh, first_page=len(lookup.device_pages))
    cache.finish(lookup, tokens, lookup.device_pages + fresh)
    return lookup.lengths()


@pytest.mark.parametrize("policy", list(WritePolicy))
@pytest.mark.parametrize("layout", list(MemLayout))
def test_random_workload_hits_are_exact_and_nothing_leaks(policy, layout):
    rng = random.Random(f"{policy}-{layout}")
    docs = [[rng.randrange(50) for _ in range(rng.randrange(8, 40))] for _ in range(6)]
    totals = {"prefix": 0, "loaded": 0}
    with make_cache(policy, layout) as cache:
        for _ in range(60):
            tokens = rng.choice(docs) + [rng.randrange(50) for _ in range(rng.randrange(0, 9))]
            lengths = serve(cache, tokens)
            if lengths is not None:
                assert lengths.prefix_len + lengths.host_loaded_length + lengths.extend_len == len(tokens)
                totals["prefix"] += lengths.prefix_len
                totals["loaded"] += lengths.host_loaded_length
        cache.flush()
        stats = cache.tree.stats()
        assert stats.device_protected_pages == 0 and stats.host_protected_pages == 0
        tree_device = sum(len(n.value) for n in cache.tree.nodes() if n.value is not None)
        tree_host = sum(len(n.host_value) for n in cache.tree.nodes() if n.host_value is not None)
        assert cache.device_pool.allocator.num_used == tree_device  # no leaked L1 page
        assert cache.host_pool.allocator.num_used == tree_host  # no leaked L2 page
    assert totals["prefix"] > 0
    if policy is not WritePolicy.WRITE_THROUGH_SELECTIVE:
        assert totals["loaded"] > 0, "the workload never exercised load-back"


def test_l2_hit_is_loaded_back_with_both_io_backends():
    for io in IoBackend:
        with make_cache(io=io, device_pages=12) as cache:
            a, b = list(range(40)), list(range(100, 140))
            serve(cache, a)
            serve(cache, b)  # evicts a to L2
            lengths = serve(cache, a)
            assert lengths.host_loaded_length == 40 and lengths.extend_len == 0


def test_selective_policy_backs_up_on_second_hit_only():
    with make_cache(WritePolicy.WRITE_THROUGH_SELECTIVE) as cache:
        doc = list(range(16))
        serve(cache, doc)
        cache.flush()
        assert cache.counters.backed_up_tokens == 0
        serve(cache, doc + [1])
        serve(cache, doc + [2])
        cache.flush()
        assert cache.counters.backed_up_tokens == 16


def test_threshold_and_quota_refusals_are_counted_and_recomputed():
    with make_cache(device_pages=12, threshold=64) as cache:
        a, b = list(range(40)), list(range(100, 140))
        serve(cache, a)
        serve(cache, b)
        lengths = serve(cache, a)
        assert lengths.host_hit_length == 40 and lengths.host_loaded_length == 0
        assert lengths.extend_len == 40
        assert cache.counters.unloaded_below_threshold_tokens == 40


def test_empty_prompt_and_exhausted_capacity_are_results():
    with make_cache(device_pages=4) as cache:
        assert serve(cache, []).extend_len == 0
        assert serve(cache, list(range(100))) is None  # 25 pages never fit in 4
        assert cache.device_pool.allocator.num_used == 0
        assert serve(cache, list(range(8))).extend_len == 8  # still serving


def test_abort_releases_everything():
    with make_cache() as cache:
        serve(cache, list(range(16)))
        lookup = cache.lookup(list(range(24)))
        fresh = cache.allocate(2)
        cache.abort(lookup, fresh)
        cache.flush()
        assert cache.tree.stats().device_protected_pages == 0
        assert cache.device_pool.allocator.num_used == 4


def test_hierarchy_off_keeps_l1_only():
    """--disable-hierarchical-cache: L1 hits as usual, nothing is copied to L2, no L3."""
    with build_cache(SPEC, 8, enable_hierarchical_cache=False) as cache:
        tokens = list(range(1, 17))
        look = cache.lookup(tokens)
        pages = cache.allocate(4)
        cache.finish(look, tokens, pages)
        cache.flush()
        hit = cache.lookup(tokens)
        assert hit.prefix_len == 16
        cache.abort(hit)
        assert cache.counters.backed_up_tokens == 0 and cache.host_pool.num_pages == 1
        cache.evict_device(8)
        again = cache.lookup(tokens)
        assert again.prefix_len == 0 and again.host_hit_length == 0
        with pytest.raises(CacheUsageError, match="hierarchical cache is off"):
            cache.attach_storage(object())


def _stored_in_l3(cache: HierarchicalCache) -> list[int]:
    """Four pages computed, copied to L2 and backed up to L3; their tokens."""
    tokens = list(range(1, 17))
    look = cache.lookup(tokens)
    cache.finish(look, tokens, cache.allocate(4))
    cache.flush()
    cache.storage.drain()
    return tokens


def test_a_new_l3_backend_gets_every_page_written_again(tmp_path):
    """Pages marked "in L3" were in the old backend; after detach + attach of an empty one,
    the next backups write them again."""
    from kvtier.backends.base import StorageTarget
    from kvtier.backends.registry import create_backend

    with build_cache(SPEC, 16, storage_backend="file",
                     storage_options={"root_dir": str(tmp_path / "old")}) as cache:
        tokens = _stored_in_l3(cache)
        assert all(n.storage_op for n in cache.tree.nodes())  # stored in the old backend
        cache.detach_storage()
        cache.attach_storage(create_backend("file", StorageTarget(cache.namespace, cache.heads),
                                            {"root_dir": str(tmp_path / "new")}))
        cache.flush()  # attaching queued the L2 pages' backups to the new backend
        cache.storage.drain()
        assert cache.storage.backend.exists(cache.storage.page_keys(tokens)).usable_pages == 4


def test_an_emptied_l3_gets_every_page_written_again(tmp_path):
    """A purge empties the namespace behind the cache: `storage_emptied` forgets the "in L3"
    marks and backs up what L2 holds again, over the same backend client."""
    with build_cache(SPEC, 16, storage_backend="file",
                     storage_options={"root_dir": str(tmp_path)}) as cache:
        tokens = _stored_in_l3(cache)
        keys = cache.storage.page_keys(tokens)
        backend = cache.storage.backend
        assert backend.delete(keys) == 4 and backend.exists(keys).usable_pages == 0
        cache.storage_emptied()
        cache.flush()
        cache.storage.drain()
        assert backend.exists(keys).usable_pages == 4 and cache.storage.backend is backend


def test_named_methods_answer_without_reaching_into_the_tree():
    """peek, release_pages, evict_host, drop_unlocked and audit: what admission, rank actors and
    benches use instead of the tree and the allocators."""
    tokens = list(range(12))
    with make_cache(device_pages=8) as cache:
        assert cache.peek(tokens) == (0, 0) and cache.device_pages == 8
        serve(cache, tokens)
        cache.flush()
        assert cache.peek(tokens) == (12, 0)  # three pages in L1
        assert cache.peek(tokens).device_hit_length == 12
        cache.evict_device(cache.device_pages)
        assert cache.peek(tokens) == (0, 12)  # demoted: the L2 copies stay
        assert cache.used_host_pages == 3 and cache.free_device_pages == 8
        spare = cache.allocate(2)
        assert cache.audit().stray_device_pages == 2  # handed out, held by nobody yet
        cache.release_pages(spare)
        before = cache.counters.evicted_host_tokens
        assert cache.evict_host(1).freed_pages >= 1
        assert cache.counters.evicted_host_tokens > before
        serve(cache, tokens)
        cache.drop_unlocked()
        assert cache.peek(tokens) == (0, 0) and cache.used_host_pages == 0
        assert cache.audit() == (0, 0, 0, 0, 0, 0)


def test_audit_counts_a_lock_that_was_never_released():
    tokens = list(range(8))
    with make_cache() as cache:
        serve(cache, tokens)
        lookup = cache.lookup(tokens)  # locked, never finished or aborted
        cache.flush()
        audit = cache.audit()
        assert audit.locked_nodes >= 1 and audit.leaked_locks >= 1 and audit.leaked_pages == 0
        cache.abort(lookup)
        assert cache.audit().leaked_locks == 0


@pytest.mark.parametrize("layout", [MemLayout.LAYER_FIRST, MemLayout.PAGE_FIRST,
                                    MemLayout.PAGE_FIRST_DIRECT])
def test_attaching_l3_at_run_time_turns_l2_into_page_head(tmp_path, layout):
    """A cache built without L3 keeps its own layout; attaching one moves L2 to page_head
    (same page ids, same bytes): L2 hits stay exact and every page reaches L3."""
    from kvtier.backends.base import StorageTarget
    from kvtier.backends.registry import create_backend

    tokens = list(range(1, 33))  # 8 pages
    with make_cache(layout=layout) as cache:
        serve(cache, tokens)
        cache.flush()
        cache.attach_storage(create_backend("file", StorageTarget(cache.namespace, cache.heads),
                                            {"root_dir": str(tmp_path)}))
        assert cache.host_pool.layout is cache.config.mem_layout is MemLayout.PAGE_HEAD
        cache.flush()
        cache.storage.drain()
        keys = cache.storage.page_keys(tokens)
        assert cache.storage.backend.exists(keys).usable_pages == 8
        cache.evict_device(cache.device_pool.num_pages)  # what is left is L2's
        lengths = serve(cache, tokens)  # asserts the loaded KV equals the reference
        assert lengths.host_loaded_length == 32


def test_deterministic_and_default_caches_on_one_root_never_read_each_others_pages(tmp_path):
    """Deterministic mode promises answers bit-identical to a cold run, which pages computed
    in batches (the default mode) break: the modes key their pages apart (the layout
    fingerprint), so over one L3 root neither reads what the other stored."""
    from kvtier.tiers.reference_kv import serve_reference

    cfg = HiCacheConfig(page_size=4, storage_backend="file", prefetch_policy="wait_complete",
                        prefetch_threshold_tokens=4, storage_options={"root_dir": str(tmp_path)})
    docs = {True: list(range(1, 17)), False: list(range(101, 117))}  # by the mode storing it

    def cache(deterministic: bool) -> HierarchicalCache:
        return build_cache(SPEC, 16, cfg, deterministic=deterministic)

    for deterministic, doc in docs.items():
        with cache(deterministic) as writer:
            serve_reference(writer, doc)
            writer.flush()
            writer.storage.drain()
    for deterministic, own in docs.items():
        with cache(deterministic) as reader:
            other = docs[not deterministic]
            assert serve_reference(reader, other + [7]).lengths().storage_hit_length == 0
            assert serve_reference(reader, own + [7]).lengths().storage_hit_length == 16
    with cache(True) as det, cache(False) as batched:
        assert det.namespace.layout_fingerprint != batched.namespace.layout_fingerprint
