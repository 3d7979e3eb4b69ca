"""L3 faults under the engine (tiny model, file L3 behind a fault-injecting wrapper): a
backend that errors, hangs, writes or reads in part, is detached mid-prefetch, fills up, or
holds corrupted objects. Every request is answered with the cold run's tokens, the pools
return to their baseline (no leaked pages or locks) and the fault is counted."""
from __future__ import annotations

import os
import random

import pytest
import torch
from cache_builder import build_cache
from eventually import eventually
from test_scheduler import assert_no_leaks, toks

from kvtier.backends.base import StorageTarget
from kvtier.backends.faulty import FaultKind, FaultyBackend, StorageOp
from kvtier.backends.registry import create_backend
from kvtier.config import HiCacheConfig
from kvtier.engine import Engine, SamplingParams
from kvtier.tiers.hierarchical_cache import HierarchicalCache

PAGE = 16
PARAMS = SamplingParams(max_new_tokens=5)
DOCS = [toks(6 * PAGE, seed=s) for s in range(4)]
PROMPTS = [d + toks(5, seed=100 + i) for i, d in enumerate(DOCS)]

pytestmark = pytest.mark.timeout(120)


def config(policy: str = "timeout", **extra) -> HiCacheConfig:
    knobs = {"page_size": PAGE, "hicache_ratio": 4.0, "load_back_threshold_tokens": PAGE,
             "prefetch_policy": policy, "prefetch_threshold_tokens": PAGE,
             "prefetch_timeout_base_s": 0.3, "prefetch_timeout_per_ki_token_s": 0.0,
             "prefetch_timeout_max_s": 0.3, "storage_batch_pages": 2,
             "mem_layout": "page_head", **extra}  # L3 is attached after: L2 as L3 needs
    return HiCacheConfig.from_dict(knobs)


def faulty_cache(model, root, cfg: HiCacheConfig, options: dict | None = None
                 ) -> tuple[HierarchicalCache, FaultyBackend]:
    cache = build_cache(model.kv_spec(PAGE), 64, cfg, model="tiny")
    inner = create_backend("file", StorageTarget(cache.namespace, cache.heads),
                           {"root_dir": str(root), **(options or {})})
    faulty = FaultyBackend(inner)
    cache.attach_storage(faulty)
    return cache, faulty


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models[torch.float32]


@pytest.fixture(scope="module")
def cold(model) -> list[tuple[int, ...]]:
    cache = build_cache(model.kv_spec(PAGE), 64, config("best_effort"), model="tiny")
    with Engine(model, cache, owns_cache=True) as eng:
        return [o.tokens for o in eng.generate(PROMPTS, PARAMS)]


def fill_l3(model, root) -> None:
    """Another instance computed every document and backed it up to L3."""
    cache, _ = faulty_cache(model, root, config())
    with Engine(model, cache, owns_cache=True) as eng:
        eng.generate(PROMPTS, PARAMS)
        cache.flush()
        cache.storage.drain()


def serve(model, cache, prompts=PROMPTS) -> list:
    eng = Engine(model, cache)
    return eng.generate(prompts, PARAMS)


@pytest.mark.parametrize("kind", [FaultKind.ERROR, FaultKind.HANG, FaultKind.PARTIAL,
                                  FaultKind.TORN])
def test_a_failing_l3_read_is_recomputed(model, cold, tmp_path, kind):
    fill_l3(model, tmp_path)
    cache, faulty = faulty_cache(model, tmp_path, config())
    faulty.inject(StorageOp.GET, kind, times=-1)
    try:
        outs = serve(model, cache)
        assert [o.tokens for o in outs] == cold
        assert faulty.faults.total >= 1
        if kind in (FaultKind.ERROR, FaultKind.HANG):
            assert sum(o.cached.storage for o in outs) == 0
        counters = cache.storage.counters
        assert counters.unfulfilled_storage_transfer_tokens > 0 or kind is FaultKind.ERROR
    finally:
        faulty.clear()  # a hung read returns (failing) so the worker can stop
    assert_no_leaks(cache)
    cache.close()


def test_hangs_end_with_the_timeout_policy_and_l3_works_after(model, cold, tmp_path):
    fill_l3(model, tmp_path)
    cache, faulty = faulty_cache(model, tmp_path, config())
    faulty.inject(StorageOp.GET, FaultKind.HANG, times=1)
    first = serve(model, cache, PROMPTS[:1])[0]
    assert first.tokens == cold[0] and first.cached.storage == 0  # waited 0.3 s, recomputed
    assert faulty.faults.injected == {"get:hang": 1}  # the read hung: not merely missed
    faulty.release()
    later = serve(model, cache, PROMPTS[1:2])[0]
    assert later.tokens == cold[1] and later.cached.storage > 0  # L3 serves again
    assert_no_leaks(cache)
    cache.close()


def test_partial_and_failed_writes_are_counted_and_never_hit(model, cold, tmp_path):
    writer, faulty = faulty_cache(model, tmp_path, config())
    faulty.inject(StorageOp.SET, FaultKind.PARTIAL, times=-1)
    with Engine(model, writer, owns_cache=True) as eng:
        eng.generate(PROMPTS[:2], PARAMS)
        writer.flush()
        writer.storage.drain()
        assert writer.storage.counters.backup_failed_tokens > 0
        assert faulty.faults.injected.get("set:partial", 0) >= 1
        faulty.clear()
    reader, _ = faulty_cache(model, tmp_path, config())
    outs = serve(model, reader, PROMPTS[:2])
    assert [o.tokens for o in outs] == cold[:2]
    assert all(o.cached.storage < 6 * PAGE for o in outs)  # only what was written, if any
    assert_no_leaks(reader)
    reader.close()


def test_detach_while_prefetches_are_in_flight_leaks_nothing(model, cold, tmp_path):
    fill_l3(model, tmp_path)
    cache, faulty = faulty_cache(model, tmp_path, config("wait_complete"))
    faulty.inject(StorageOp.GET, FaultKind.DELAY, times=-1, delay_s=0.2)
    eng = Engine(model, cache)
    ids = [eng.add_request(p, PARAMS) for p in PROMPTS]
    eng.step()  # prefetches start
    # a (slow) read is in flight: without this wait the detach could come first
    eventually(lambda: faulty.faults.injected.get("get:delay"), 10, "an L3 read began")
    cache.detach_storage()  # the operator pulls L3 out from under them
    outs = {}
    while eng.has_unfinished:
        outs.update({o.request_id: o for o in eng.step()})
    assert [outs[i].tokens for i in ids] == cold
    assert_no_leaks(cache)
    cache.close()


def test_a_full_l3_drops_writes_and_serving_goes_on(model, cold, tmp_path):
    cap = 4 * model.kv_spec(PAGE).page_bytes  # room for 4 of the 24 pages served
    cache, faulty = faulty_cache(model, tmp_path, config(), {"max_size_bytes": cap})
    with Engine(model, cache) as eng:
        outs = eng.generate(PROMPTS, PARAMS)
    assert [o.tokens for o in outs] == cold
    cache.flush()
    cache.storage.drain()
    stats = faulty.inner.stats()
    assert stats.evicted_pages > 0 or stats.write_failures > 0  # the quota acted, counted
    assert_no_leaks(cache)
    cache.close()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_corrupted_objects_are_caught_and_recomputed(model, cold, tmp_path, damage):
    fill_l3(model, tmp_path)
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
             if not f.startswith(".")]
    assert files
    rng = random.Random(5)
    for path in files:
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            if damage == "truncate":
                f.truncate(size // 2)
            else:
                pos = rng.randrange(size)
                f.seek(pos)
                byte = f.read(1)
                f.seek(pos)
                f.write(bytes([byte[0] ^ 0xFF]))
    cache, faulty = faulty_cache(model, tmp_path, config())
    outs = serve(model, cache)
    assert [o.tokens for o in outs] == cold  # no wrong token
    assert faulty.inner.stats().corrupt_objects > 0  # caught on read, counted
    assert_no_leaks(cache)
    cache.close()


def test_a_thousand_corrupted_objects_give_zero_wrong_tokens(model, tmp_path):
    """Flip one random byte (header or payload) in each of 1,000 stored objects: every read
    of them fails its check, and every answer equals the undisturbed one."""
    # 84 pages of 12 objects each (6 KV heads x K, V): 1,008 objects, so damaging 1,000 of
    # them leaves no page whole
    docs = [toks(21 * PAGE, seed=1000 + i) for i in range(4)]
    prompts = [d + toks(3, seed=2000 + i) for i, d in enumerate(docs)]
    writer, _ = faulty_cache(model, tmp_path, config("wait_complete"))
    with Engine(model, writer, owns_cache=True) as eng:
        cold = [o.tokens for o in eng.generate(prompts, PARAMS)]
        writer.flush()
        writer.storage.drain()
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs
                   if not f.startswith("."))
    assert len(files) == 1008
    rng = random.Random(11)
    for path in rng.sample(files, 1000):
        size = os.path.getsize(path)
        with open(path, "r+b") as f:
            pos = rng.randrange(size)
            f.seek(pos)
            byte = f.read(1)[0]
            f.seek(pos)
            f.write(bytes([byte ^ (1 << rng.randrange(8))]))
    reader, faulty = faulty_cache(model, tmp_path, config("wait_complete"))
    outs = serve(model, reader, prompts)
    wrong = sum(a != b for o, c in zip(outs, cold) for a, b in zip(o.tokens, c))
    assert wrong == 0 and [o.tokens for o in outs] == cold
    assert faulty.inner.stats().corrupt_objects >= 1  # caught on read and counted
    assert all(o.cached.storage == 0 for o in outs)  # every object is damaged: no L3 hit
    assert_no_leaks(reader)
    reader.close()
