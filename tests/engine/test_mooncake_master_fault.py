"""The Mooncake master killed mid-run and restarted, under the engine (tiny model, fp32).

The L3 namespace service owns the master (as in production); caches use it through the
namespace's page directory and their own Mooncake client, objects living in a 'holder'
client's segment (a storage node). While the master is dead every request is answered with
the cold run's tokens: reads of published pages fail (counted as unfulfilled), writes fail
(counted), nothing hangs. The service restarts the master (new address, new epoch, an EMPTY
store: Mooncake keeps objects in memory, in segments the old master managed); the rank
re-attaches a client of the new master (`detach_storage` + `attach_storage`, what
`RankActor.detach_l3` / `attach_l3` do), misses, writes again, and a fresh cache hits again.
The pools end at their baseline (no leaked pages or locks) after every phase.
"""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # before mooncake loads: INFO floods stderr
pytest.importorskip("mooncake.store")

from cache_builder import build_cache  # noqa: E402
from test_scheduler import assert_no_leaks, toks  # noqa: E402

from kvtier.actors.l3.namespace_actor import FakeNamespaceClient  # noqa: E402
from kvtier.actors.l3.namespace_service import NamespaceService  # noqa: E402
from kvtier.backends.base import StorageTarget  # noqa: E402
from kvtier.backends.registry import create_backend  # noqa: E402
from kvtier.config import HiCacheConfig  # noqa: E402
from kvtier.engine import Engine, SamplingParams  # noqa: E402
from kvtier.keys import KeyNamespace, layout_fingerprint  # noqa: E402
from kvtier.messages import NamespaceInfo, NamespaceSpec  # noqa: E402
from kvtier.storage_options import MiB  # noqa: E402
from kvtier.tiers.hierarchical_cache import HierarchicalCache  # noqa: E402
from kvtier.tiers.page_store import open_rank_backend  # noqa: E402

PAGE = 16
PARAMS = SamplingParams(max_new_tokens=5)
DOCS = [toks(6 * PAGE, seed=300 + s) for s in range(8)]
PROMPTS = [d + toks(5, seed=400 + i) for i, d in enumerate(DOCS)]
EARLY, DURING, AFTER = slice(0, 4), slice(4, 6), slice(6, 8)  # first served: before/while/after
# Bounds, not timings: a call to a dead master waits for Mooncake's RPC timeout (~4 s) at
# most once per back-off, and a client's close a few seconds more.
STEP_BOUND_S = 30.0
PHASE_BOUND_S = 120.0
# A miss waits at most this long for an L3 read (the `timeout` policy). A bound, not a
# timing: failing reads end by themselves (the dead master's RPC timeout, then the guard's
# refusals), and healthy ones take milliseconds alone but far longer on a loaded machine,
# where prefetches take turns batch by batch: under the full suite 6 prefetches of 3 batches
# each once all stopped at the same 4 pages when this was 5 s.
READ_WAIT_S = 30.0
RANK_OPTIONS = {"global_segment_size_bytes": 0, "local_buffer_size_bytes": 0}  # no segment

pytestmark = pytest.mark.timeout(420)


def config() -> HiCacheConfig:
    return HiCacheConfig.from_dict({
        "page_size": PAGE, "hicache_ratio": 4.0, "load_back_threshold_tokens": PAGE,
        "prefetch_policy": "timeout", "prefetch_threshold_tokens": PAGE,
        "prefetch_timeout_base_s": READ_WAIT_S, "prefetch_timeout_per_ki_token_s": 0.0,
        "prefetch_timeout_max_s": READ_WAIT_S, "storage_batch_pages": 2,
        "mem_layout": "page_head"})


class SupervisedByHand(FakeNamespaceClient):
    """The namespace service without its 1 s supervisor rounds: the test says when the dead
    master is noticed (`service.supervise()`), so 'meanwhile' is a phase, not a race."""

    def __init__(self) -> None:  # noqa: D107 - FakeNamespaceClient's, with a long interval
        self.service = NamespaceService(supervise_interval_s=3600.0)


def holder(info: NamespaceInfo):
    """A client whose segment stores the objects (a storage node): rank clients have none, so
    pages outlive the caches that wrote them, as long as this master lives."""
    return create_backend("mooncake", StorageTarget(KeyNamespace("holder")),
                          {"master_address": info.options["master_address"],
                           "global_segment_size_bytes": 16 * MiB, "local_buffer_size_bytes": 0})


def new_cache(model, client, info: NamespaceInfo) -> HierarchicalCache:
    """A rank's cache (fresh L1/L2) over its own client of the namespace `info`."""
    cache = build_cache(model.kv_spec(PAGE), 64, config(), model=info.spec.model,
                        directory=client)
    assert cache.namespace == info.spec.key_namespace
    cache.attach_storage(open_rank_backend(info))
    return cache


class Timed:
    """Runs engines step by step and keeps the longest step (a hang shows up here)."""

    def __init__(self) -> None:
        self.worst_s = 0.0

    def call(self, fn, *args):
        start = time.monotonic()
        try:
            return fn(*args)
        finally:
            took = time.monotonic() - start
            self.worst_s = max(self.worst_s, took)
            assert took < STEP_BOUND_S, f"{getattr(fn, '__name__', fn)} took {took:.1f} s"

    def finish(self, eng: Engine, ids: list[int]) -> list:
        outs = {}
        deadline = time.monotonic() + PHASE_BOUND_S
        while eng.has_unfinished:
            assert time.monotonic() < deadline, "requests still unanswered"
            outs.update({o.request_id: o for o in self.call(eng.step)})
        return [outs[i] for i in ids]

    def serve(self, model, cache, prompts) -> list:
        eng = Engine(model, cache)
        return self.finish(eng, [eng.add_request(p, PARAMS) for p in prompts])


@pytest.fixture(scope="module")
def model(tiny_models):
    return tiny_models[torch.float32]


@pytest.fixture(scope="module")
def cold(model) -> list[tuple[int, ...]]:
    """Every prompt's answer with no L3 at all."""
    cache = build_cache(model.kv_spec(PAGE), 64, config(), model="tiny")
    with Engine(model, cache, owns_cache=True) as eng:
        return [o.tokens for o in eng.generate(PROMPTS, PARAMS)]


def settle(cache: HierarchicalCache, timed: Timed) -> None:
    """Wait for L2 copies and L3 backups (bounded), then check nothing leaked."""
    timed.call(assert_no_leaks, cache)


def tokens(outs) -> list:
    return [o.tokens for o in outs]


def test_master_killed_mid_run_then_restarted(model, cold):
    timed = Timed()
    kv = model.kv_spec(PAGE)
    fingerprint = layout_fingerprint(kv, kv.num_kv_heads)
    spec = NamespaceSpec("tiny", "", fingerprint, "mooncake", dict(RANK_OPTIONS),
                         kv_heads=kv.num_kv_heads)
    closing: list = []  # closed at the end whatever happens, newest first
    client = SupervisedByHand()
    try:
        info = client.register(spec)
        assert info.epoch == 1
        closing.append(holder(info))
        master = client.service._masters[spec.namespace]

        # ---- 1. a healthy master: cold answers, backed up, a fresh cache hits them -------
        with new_cache(model, client, info) as writer:
            assert tokens(timed.serve(model, writer, PROMPTS[EARLY])) == cold[EARLY]
            settle(writer, timed)
            assert writer.storage.counters.backed_up_tokens == 4 * 6 * PAGE
        assert client.stats(info.namespace).published_pages == 4 * 6
        with new_cache(model, client, info) as reader:
            outs = timed.serve(model, reader, PROMPTS[EARLY])
            assert tokens(outs) == cold[EARLY]
            assert all(o.cached.storage == 6 * PAGE for o in outs)  # sanity: L3 serves
            settle(reader, timed)

        # ---- 2. the master is SIGKILLed while requests are running ---------------------
        cache = new_cache(model, client, info)  # "the cache": it lives through every phase
        closing.append(cache)
        late = new_cache(model, client, info)  # will ask for published pages after the kill
        closing.append(late)
        eng = Engine(model, cache)
        ids = [eng.add_request(p, PARAMS) for p in PROMPTS[EARLY]]
        done = {o.request_id: o for o in timed.call(eng.step)}  # lookups, prefetches start
        os.kill(master.pid, signal.SIGKILL)
        master.proc.wait(10)
        outs = timed.finish(eng, [i for i in ids if i not in done])
        assert tokens([done[i] for i in ids if i in done] + outs) == cold[EARLY]
        outs = timed.serve(model, cache, PROMPTS[DURING])  # first seen now: cannot be stored
        assert tokens(outs) == cold[DURING] and all(o.cached.storage == 0 for o in outs)
        settle(cache, timed)
        stats = cache.storage.backend.stats()
        assert cache.storage.counters.backup_failed_tokens >= 2 * 6 * PAGE
        assert stats.write_failures > 0 and stats.extra["master_outages"] == 1
        assert stats.extra["calls_while_master_down"] > 0
        # The pages written before the kill went with the master. A cache that asks for them
        # reads nothing and answers cold; whichever cache read a published one first found
        # it missing and told the directory (report_missing), which unpublished it.
        outs = timed.serve(model, late, PROMPTS[EARLY])
        assert tokens(outs) == cold[EARLY] and all(o.cached.storage == 0 for o in outs)
        assert client.stats(info.namespace).vanished_pages > 0
        settle(late, timed)
        assert late.storage.backend.stats().extra["master_outages"] == 1  # its backups saw it

        # ---- 3. the service restarts it: new address, new epoch, an empty store ---------
        assert client.service.supervise() == 1
        info2 = client.info(info.namespace)
        new_address = info2.options["master_address"]
        assert info2.epoch == 2 and new_address != info.options["master_address"]
        assert client.stats(info.namespace).published_pages == 0
        closing.append(holder(info2))
        # The rank sees the epoch moved and re-attaches (RankActor.detach_l3 / attach_l3).
        timed.call(cache.detach_storage)
        assert_no_leaks(cache)
        cache.attach_storage(open_rank_backend(info2))
        assert cache.storage.backend.master_address == new_address
        outs = timed.serve(model, cache, PROMPTS[AFTER])  # first seen: misses, then written
        assert tokens(outs) == cold[AFTER] and all(o.cached.storage == 0 for o in outs)
        settle(cache, timed)
        # attaching wrote what L2 held (the 6 documents served so far) to the empty store,
        # then the 2 new ones were written as they were served
        assert cache.storage.counters.backed_up_tokens == 8 * 6 * PAGE

        # ---- 4. the new store has everything again: fresh caches hit all of it ----------
        fresh = new_cache(model, client, info2)
        closing.append(fresh)
        outs = timed.serve(model, fresh, PROMPTS[EARLY] + PROMPTS[AFTER])
        assert tokens(outs) == cold[EARLY] + cold[AFTER]
        assert [o.cached.storage for o in outs] == [6 * PAGE] * 6
        settle(fresh, timed)
        assert fresh.storage.counters.backed_up_tokens == 0  # nothing left to write
        again = new_cache(model, client, info2)
        closing.append(again)
        outs = timed.serve(model, again, PROMPTS)
        assert tokens(outs) == cold
        assert [o.cached.storage for o in outs] == [6 * PAGE] * len(PROMPTS)  # DURING too
        settle(again, timed)
        assert_no_leaks(cache)
        print(f"\nworst engine step / cache call while the master was down or back: "
              f"{timed.worst_s:.2f} s")
    finally:
        start = time.monotonic()
        for thing in reversed(closing):
            thing.close()
        client.close()
        assert time.monotonic() - start < PHASE_BOUND_S


def test_a_dead_master_is_asked_once_then_probed(model, monkeypatch):
    """Mooncake's health flag stays OK after its master dies and each RPC to it waits ~4.5 s:
    after one failed RPC the backend asks nothing until the master's port opens again."""
    from kvtier.backends import mooncake_master_guard
    from kvtier.backends.mooncake_backend import MooncakeBackend
    from kvtier.backends.mooncake_master import MooncakeMaster
    from kvtier.storage_options import MooncakeOptions
    from kvtier.tiers.host_pool import HostPool

    keys = KeyNamespace("probe").page_hashes(list(range(4 * PAGE)), PAGE)
    from kvtier.kv_spec import HeadRange
    from kvtier.policies import MemLayout

    backoff_s = 0.2  # the guard's back-off, short here: the test outlasts two of them
    monkeypatch.setattr(mooncake_master_guard, "RPC_BACKOFF_S", backoff_s)
    kv = model.kv_spec(PAGE)
    with MooncakeMaster() as master, HostPool(kv, 8, MemLayout.PAGE_HEAD) as pool:
        backend = MooncakeBackend(MooncakeOptions(master_address=master.address, **RANK_OPTIONS),
                                  StorageTarget(KeyNamespace("probe"),
                                                HeadRange.all_of(kv.num_kv_heads)))
        try:
            backend.register_pool("kv", pool)
            assert backend.exists(keys).usable_pages == 0  # asked: the master answers
            master.proc.kill()
            master.proc.wait(10)
            start = time.monotonic()
            failed_at = None
            while failed_at is None or time.monotonic() < failed_at + 3 * backoff_s:
                assert backend.exists(keys).usable_pages == 0
                assert backend.get_into("kv", keys, [0, 1, 2, 3]).ok == [False] * 4
                assert backend.set_from("kv", keys, [4, 5, 6, 7]).ok == [False] * 4
                if failed_at is None and backend.stats().extra["rpc_failures"]:
                    failed_at = time.monotonic()  # the back-offs run from here: outlast two
                assert time.monotonic() - start < PHASE_BOUND_S, "no RPC to the master failed"
                time.sleep(0.05)
            extra = backend.stats().extra
            assert extra["rpc_failures"] == 1 and extra["master_outages"] == 1
            assert extra["calls_while_master_down"] > 0
            assert time.monotonic() - start < PHASE_BOUND_S  # bounded: no hang
        finally:
            backend.close()
