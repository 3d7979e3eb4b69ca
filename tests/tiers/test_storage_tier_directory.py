"""L3 through the page directory (docs/architecture.md invariant 3), no Ray: a page is an L3 hit
only once every TP rank of its writer reported it stored; leases cover prefetches; a failing
directory means misses, never errors."""
import random

import pytest
import torch
from cache_builder import build_cache

from kvtier.kv_spec import KVSpec
from kvtier.messages import NamespaceSpec, StorageBackendKind
from kvtier.policies import PrefetchPolicy, WritePolicy
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.reference_kv import serve_reference

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
DOC = list(range(100, 140))  # 10 pages


class NullStore:
    """A PageStore that deletes nothing (the directory's quota is unbounded here)."""

    listable = False

    def __init__(self, info):
        self.info = info

    def delete(self, hashes):
        return len(hashes)

    def list_pages(self):
        return {}

    def reclaim_old_format(self):
        return 0

    def close(self):
        pass


class BrokenDirectory:
    """Every call fails, as a namespace actor that is down would."""

    def __init__(self):
        self.calls = 0

    def _fail(self, *args, **kwargs):
        self.calls += 1
        raise TimeoutError("the L3 namespace actor did not answer")

    report_stored = lookup = release = _fail


def make(seed, directory, tp_rank=0, tenant="", prefetch=PrefetchPolicy.WAIT_COMPLETE):
    return build_cache(SPEC, 32, tenant_salt=tenant, tp_rank=tp_rank, tp_size=2,
                       directory=directory, write_policy=WritePolicy.WRITE_THROUGH,
                       prefetch_policy=prefetch, hicache_ratio=2.0, prefetch_threshold_tokens=8,
                       load_back_threshold_tokens=4, storage_batch_pages=3,
                       storage_backend="simulated", storage_options={"seed": seed})


def register(directory, cache) -> str:
    ns = cache.namespace
    info = directory.register(NamespaceSpec(ns.model, ns.tenant_salt, ns.layout_fingerprint,
                                            StorageBackendKind.SIMULATED, {},
                                            kv_heads=cache.heads.total))
    assert info.namespace == ns.name
    return info.namespace


def serve(cache, tokens):
    """Prefetch (wait), lookup + load-back, compute the rest, store; the five lengths."""
    done = serve_reference(cache, tokens)
    assert done.kv_ok, "a hit returned KV that differs from recompute"
    return done.lengths()


def settle(cache):
    cache.flush()
    cache.storage.drain()
    cache.flush()


@pytest.fixture
def directory():
    with PageDirectory(NullStore) as d:
        yield d


def test_a_page_is_a_hit_only_after_every_rank_reported_it(directory):
    seed = random.getrandbits(48)
    with make(seed, directory, 0) as r0, make(seed, directory, 1) as r1:
        ns = register(directory, r0)
        serve(r0, DOC)
        settle(r0)  # rank 0's part is in the backend and reported; rank 1 has not written
        assert r0.storage.counters.directory_reported_pages == 10
        assert directory.stats(ns).pending_pages == 10
        assert directory.stats(ns).published_pages == 0
        with make(seed, directory, 0) as c:  # a third cache: rank 0 of another instance
            assert c.prefetch(DOC + [7]) is None  # its backend holds the pages; not published
            assert c.storage.counters.storage_hit_tokens == 0
        serve(r1, DOC)
        settle(r1)
        assert directory.stats(ns).published_pages == 10
        with make(seed, directory, 0) as c:
            lengths = serve(c, DOC + [7, 7])
            assert lengths.storage_hit_length == 40 and lengths.extend_len == 2
            assert c.storage.counters.prefetched_tokens == 40
            assert c.storage.counters.directory_errors == 0
        stats = directory.stats(ns)
        assert stats.leases_granted == 1 and stats.leases_active == 0  # released on finish


def test_the_hit_is_what_the_directory_published(directory):
    """The directory, not the backend, says how far L3 goes: only the published prefix."""
    seed = random.getrandbits(48)
    with make(seed, directory, 0) as r0, make(seed, directory, 1) as r1:
        ns = register(directory, r0)
        serve(r0, DOC)
        settle(r0)
        serve(r1, DOC[:24])  # rank 1 wrote only the first 6 pages
        settle(r1)
        assert directory.stats(ns).published_pages == 6
        with make(seed, directory, 1) as c:
            assert serve(c, DOC + [7]).storage_hit_length == 24


def test_leases_are_released_after_abort(directory):
    seed = random.getrandbits(48)
    with make(seed, directory, 0) as r0, make(seed, directory, 1) as r1:
        ns = register(directory, r0)
        for r in (r0, r1):
            serve(r, DOC)
            settle(r)
        with make(seed, directory, 0) as c:
            ticket = c.prefetch(DOC + [7])
            assert ticket is not None and ticket.lease_id
            assert directory.stats(ns).leases_active == 1
            c.abort_prefetch(ticket)
            assert directory.stats(ns).leases_active == 0
            ticket = c.prefetch(DOC + [7])  # and a prefetch still running at close
            assert directory.stats(ns).leases_active == 1
        assert directory.stats(ns).leases_active == 0


def test_a_failing_directory_gives_misses_and_keeps_serving(directory):
    seed = random.getrandbits(48)
    with make(seed, directory, 0) as r0, make(seed, directory, 1) as r1:
        register(directory, r0)
        for r in (r0, r1):
            serve(r, DOC)
            settle(r)
    broken = BrokenDirectory()
    with make(seed, broken, 0) as c:  # the backend holds every part, but the directory is down
        for _ in range(2):
            lengths = serve(c, DOC + [7, 7])
            assert lengths.storage_hit_length == 0
        settle(c)  # its own backups' reports fail too: counted, not raised
        counters = c.storage.counters
        assert counters.storage_hit_tokens == 0 and counters.prefetched_tokens == 0
        assert counters.directory_errors >= 2 and broken.calls == counters.directory_errors
        assert serve(c, DOC + [7, 7]).prefix_len == 40  # L1 still serves


def test_tenants_are_isolated(directory):
    seed = random.getrandbits(48)
    with make(seed, directory, 0, "a") as a0, make(seed, directory, 1, "a") as a1:
        ns_a = register(directory, a0)
        for r in (a0, a1):
            serve(r, DOC)
            settle(r)
        with make(seed, directory, 0, "b") as b:
            ns_b = register(directory, b)
            assert ns_b != ns_a
            assert serve(b, DOC + [7]).storage_hit_length == 0
            assert directory.stats(ns_b).published_pages == 0
        with make(seed, directory, 0, "a") as c:
            assert serve(c, DOC + [7]).storage_hit_length == 40


class FlakyDirectory:
    """A real directory behind a switch: while `down`, every call fails."""

    def __init__(self, directory):
        self.directory, self.down = directory, False

    def __getattr__(self, name):
        real = getattr(self.directory, name)

        def call(*args, **kwargs):
            if self.down:
                raise TimeoutError("the L3 namespace actor did not answer")
            return real(*args, **kwargs)
        return call


def test_reports_that_failed_are_sent_again_when_the_directory_is_back(directory):
    seed = random.getrandbits(48)
    flaky = FlakyDirectory(directory)
    with make(seed, flaky, 0) as r0, make(seed, directory, 1) as r1:
        ns = register(directory, r0)
        serve(r1, DOC)
        settle(r1)
        flaky.down = True
        serve(r0, DOC)
        settle(r0)  # rank 0's report fails: its pages wait, unpublished
        assert r0.storage.counters.directory_errors >= 1
        assert directory.stats(ns).published_pages == 0
        flaky.down = False
        serve(r0, DOC[:8] + [9] * 8)  # any later poll reports again, the old pages first
        settle(r0)
        assert directory.stats(ns).published_pages == 10
        with make(seed, directory, 0) as c:
            assert serve(c, DOC + [7]).storage_hit_length == 40
