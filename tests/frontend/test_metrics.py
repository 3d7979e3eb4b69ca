"""ServeMetrics: every family rendered with the prefix, snapshot deltas, restarts, histograms."""
from __future__ import annotations

import dataclasses

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from kvtier.backends.base import BackendStats
from kvtier.engine.request import CachedTokens
from kvtier.engine.retraction import RetractionCounters
from kvtier.frontend.metrics import (CACHE_COUNTERS, CACHE_SOURCES, COUNTERS, GAUGES, HISTOGRAMS,
                                     NAMESPACE_COUNTERS, NAMESPACE_GAUGES, STORAGE_SOURCES,
                                     TIER_GAUGES, MetricsError, RankFaults, ServeMetrics, _src,
                                     check_sources, counter_deltas, field_names)
from kvtier.frontend.records import NO_CACHED
from kvtier.tiers.cache_types import CacheCounters
from kvtier.tiers.controller import TransferStats
from kvtier.tiers.storage_types import StorageCounters


def families(m: ServeMetrics) -> dict:
    body, content_type = m.render()
    assert content_type.startswith("text/plain")
    return {f.name: f for f in text_string_to_metric_families(body.decode())}


def value(m: ServeMetrics, family: str, suffix: str = "", **labels) -> float:
    """The value of one sample; 0.0 when the series does not exist."""
    name = "kvtier_" + family
    fam = families(m).get(name)
    if fam is None:
        return 0.0
    for s in fam.samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return 0.0


def cache_snapshot(**kw) -> dict:
    return CacheCounters(**kw).snapshot()


def test_every_family_is_rendered_with_the_prefix_and_an_instance_label():
    m = ServeMetrics()
    m.observe_request("a", 0.2, 0.01, CachedTokens(64, 32, 0), "stop",
                      prompt_tokens=100, generation_tokens=5, e2e_s=0.3, queue_s=0.05)
    m.update_gauges("a", {"device_used_tokens": 64, "device_total_tokens": 640,
                          "running_requests": 1, "waiting_requests": 2, "unknown": 3})
    m.observe_agreement("a", [2e-5])
    m.observe_storage_transfer("a", True, 1 << 20, 0.01)
    m.observe_storage_transfer("a", False, 1 << 20, 0.01)
    transfers = {"load_bytes": 0, "load_s": 0.0, "write_bytes": 0, "write_s": 0.0}
    backend = {"bytes_read": 0, "bytes_written": 0, "evicted_pages": 0, "write_failures": 0,
               "corrupt_objects": 0}
    restarts = {"rank_restarts": 0, "rank_divergences": 0}
    retractions = {"retracted_requests": 1, "restored_requests": 1, "retract_fallbacks": 0}
    m.update_cache("a", cache_snapshot(lookups=1) | transfers | restarts | retractions, 10, 100,
                   StorageCounters().snapshot() | backend)
    m.update_liveness("a", stalls=1, stalled=False)
    m.observe_redispatch("a")
    m.update_pins("a", {"pins": 1, "device_pages": 0, "host_pages": 3})
    m.update_namespace("ns-1", {"evicted_pages": 3, "published_pages": 40, "capacity_pages": 64,
                                "pins": 1, "pinned_pages": 3, "old_format_pages_reclaimed": 0,
                                "purged_pages": 0})
    fams = families(m)
    expected = set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS) | set(TIER_GAUGES)
    namespaced = set(NAMESPACE_COUNTERS) | set(NAMESPACE_GAUGES)
    assert {f"kvtier_{name}" for name in expected | namespaced} <= set(fams)
    assert all(name.startswith("kvtier_") for name in fams)
    for fam in fams.values():
        assert fam.samples, fam.name
        family = fam.name.removeprefix("kvtier_").removesuffix("_created")
        label = "namespace" if family in namespaced else "kvtier_instance"
        assert all(label in s.labels and "instance" not in s.labels
                   for s in fam.samples), fam.name


def test_the_namespace_figures_are_the_directorys():
    m = ServeMetrics()
    m.update_namespace("ns-1", {"evicted_pages": 3, "published_pages": 40, "capacity_pages": 64})
    m.update_namespace("ns-1", {"evicted_pages": 5, "published_pages": 38, "capacity_pages": 64})
    assert value(m, "l3_evicted_pages", "_total", namespace="ns-1") == 5
    assert value(m, "l3_published_pages", "", namespace="ns-1") == 38
    assert value(m, "l3_capacity_pages", "", namespace="ns-1") == 64
    m.update_namespace("ns-1", {"evicted_pages": 5, "old_format_pages_reclaimed": 7,
                                "purged_pages": 12})
    assert value(m, "l3_old_format_pages_reclaimed", "_total", namespace="ns-1") == 7
    assert value(m, "l3_purged_pages", "_total", namespace="ns-1") == 12


def test_tokens_latency_and_gauges():
    m = ServeMetrics()
    m.observe_request("a", 0.1, 0.02, CachedTokens(64, 0, 0), "stop", prompt_tokens=100,
                      generation_tokens=7, e2e_s=0.5)
    m.observe_request("a", 0.1, None, NO_CACHED, "length", prompt_tokens=20,
                      generation_tokens=1)
    assert value(m, "prompt_tokens", "_total", kvtier_instance="a") == 120
    assert value(m, "generation_tokens", "_total", kvtier_instance="a") == 8
    assert value(m, "e2e_request_seconds", "_count", kvtier_instance="a") == 1
    assert value(m, "queue_seconds", "_count", kvtier_instance="a") == 0  # not reported
    m.update_gauges("a", {"running_requests": 3, "waiting_requests": 0,
                          "device_used_tokens": 128, "device_total_tokens": 1024})
    m.update_gauges("a", {"running_requests": 1})
    assert value(m, "running_requests", kvtier_instance="a") == 1
    assert value(m, "device_used_tokens", kvtier_instance="a") == 128


def test_private_registry_leaves_the_global_one_alone():
    ServeMetrics()
    ServeMetrics()  # a second one in the same process does not collide
    assert not any(n.startswith("kvtier_") for n in REGISTRY._names_to_collectors)


def test_request_observations():
    m = ServeMetrics()
    m.observe_request("a", 0.1, 0.02, CachedTokens(64, 32, 0), "stop")
    m.observe_request("a", 0.3, None, CachedTokens(0, 0, 128), "length")
    assert value(m, "cached_tokens", "_total", kvtier_instance="a", tier="device") == 64
    assert value(m, "cached_tokens", "_total", kvtier_instance="a", tier="host") == 32
    assert value(m, "cached_tokens", "_total", kvtier_instance="a", tier="storage") == 128
    assert value(m, "requests", "_total", kvtier_instance="a", finish_reason="stop") == 1
    assert value(m, "requests", "_total", kvtier_instance="a", finish_reason="length") == 1
    assert value(m, "ttft_seconds", "_count", kvtier_instance="a") == 2
    assert abs(value(m, "ttft_seconds", "_sum", kvtier_instance="a") - 0.4) < 1e-9
    assert value(m, "tpot_seconds", "_count", kvtier_instance="a") == 1


def test_agreement_histogram_uses_microsecond_buckets():
    m = ServeMetrics()
    m.observe_agreement("a", [1.5e-5, 3e-5, 4e-4])
    assert value(m, "agreement_seconds", "_count", kvtier_instance="a") == 3
    assert value(m, "agreement_seconds", "_bucket", kvtier_instance="a", le="2.5e-05") == 1
    assert value(m, "agreement_seconds", "_bucket", kvtier_instance="a", le="0.0005") == 3


def test_snapshots_become_increments():
    m = ServeMetrics()
    m.update_cache("a", cache_snapshot(lookups=2, device_hit_tokens=64, evicted_host_tokens=16,
                                       backed_up_tokens=32, written_back_tokens=8), 100, 1000)
    m.update_cache("a", cache_snapshot(lookups=5, device_hit_tokens=64, evicted_host_tokens=48,
                                       backed_up_tokens=40, written_back_tokens=8,
                                       unloaded_over_quota_tokens=7), 200, 1000)
    assert value(m, "lookups", "_total", kvtier_instance="a") == 5
    assert value(m, "hit_tokens", "_total", kvtier_instance="a", tier="device") == 64
    assert value(m, "evicted_tokens", "_total", kvtier_instance="a", tier="host") == 48
    assert value(m, "backup_tokens", "_total", kvtier_instance="a") == 48
    assert value(m, "load_back_refused_tokens", "_total", kvtier_instance="a", reason="over_quota") == 7
    assert value(m, "host_used_tokens", kvtier_instance="a") == 200
    assert value(m, "host_total_tokens", kvtier_instance="a") == 1000


def test_instances_are_kept_apart():
    m = ServeMetrics()
    m.update_cache("a", cache_snapshot(lookups=3), 0, 10)
    m.update_cache("b", cache_snapshot(lookups=10), 0, 10)
    m.update_cache("a", cache_snapshot(lookups=4), 0, 10)
    assert value(m, "lookups", "_total", kvtier_instance="a") == 4
    assert value(m, "lookups", "_total", kvtier_instance="b") == 10


def test_liveness_shows_the_stall_series_at_zero():
    m = ServeMetrics()
    m.update_liveness("a", stalls=0, stalled=False)
    rendered = {s.name: s.value for f in families(m).values() for s in f.samples}
    for name in ("kvtier_instance_stalls_total", "kvtier_redispatched_requests_total",
                 "kvtier_instance_stalled"):
        assert rendered[name] == 0, name  # graphed before anything stalled


def test_a_counter_that_goes_backwards_means_a_restart():
    m = ServeMetrics()
    m.update_cache("a", cache_snapshot(lookups=10, device_hit_tokens=100), 0, 10)
    # restarted: lookups fell to 2; device hits already grew past the old 100 again
    m.update_cache("a", cache_snapshot(lookups=2, device_hit_tokens=150), 0, 10)
    assert value(m, "lookups", "_total", kvtier_instance="a") == 12
    assert value(m, "hit_tokens", "_total", kvtier_instance="a", tier="device") == 250
    m.update_cache("a", cache_snapshot(lookups=3, device_hit_tokens=160), 0, 10)
    assert value(m, "lookups", "_total", kvtier_instance="a") == 13
    assert value(m, "hit_tokens", "_total", kvtier_instance="a", tier="device") == 260


def test_counter_deltas_skip_non_numbers():
    assert counter_deltas(None, {"a": 3, "extra": {}, "flag": True}) == {"a": 3}
    assert counter_deltas({"a": 3, "b": 1.0}, {"a": 5, "b": 1.5}) == {"a": 2, "b": 0.5}


def test_transfer_stats_feed_bytes_and_seconds():
    m = ServeMetrics()
    snap = cache_snapshot(loaded_back_tokens=64) | {"load_bytes": 4096, "load_s": 0.5,
                                                    "write_bytes": 1024, "write_s": 0.25}
    m.update_cache("a", snap, 0, 10)
    assert value(m, "load_back_tokens", "_total", kvtier_instance="a") == 64
    assert value(m, "load_back_bytes", "_total", kvtier_instance="a") == 4096
    assert value(m, "load_back_seconds", "_total", kvtier_instance="a") == 0.5
    assert value(m, "backup_bytes", "_total", kvtier_instance="a") == 1024
    assert value(m, "backup_seconds", "_total", kvtier_instance="a") == 0.25


def test_storage_snapshot_prefetch_reasons_drops_and_bandwidth():
    m = ServeMetrics()
    first = StorageCounters(prefetched_tokens=64, unfulfilled_host_capacity_tokens=32,
                            backup_failed_tokens=16, storage_hit_tokens=96).snapshot()
    m.update_cache("a", cache_snapshot(dropped_backup_tokens=8), 0, 10,
                   first | {"bytes_read": 0, "bytes_written": 0})
    second = StorageCounters(prefetched_tokens=128, unfulfilled_host_capacity_tokens=32,
                             unfulfilled_storage_transfer_tokens=64, backup_failed_tokens=16,
                             storage_hit_tokens=96, prefetch_wait_s=0.5).snapshot()
    m.update_cache("a", cache_snapshot(dropped_backup_tokens=8), 0, 10,
                   second | {"bytes_read": 500_000_000, "bytes_written": 10**9, "write_s": 2.0})
    assert value(m, "prefetch_hit_tokens", "_total", kvtier_instance="a") == 128
    assert value(m, "hit_tokens", "_total", kvtier_instance="a", tier="storage") == 96
    assert value(m, "prefetch_unfulfilled_tokens", "_total", kvtier_instance="a",
                 reason="host_capacity") == 32
    assert value(m, "prefetch_unfulfilled_tokens", "_total", kvtier_instance="a",
                 reason="storage_transfer") == 64
    assert value(m, "dropped_backup_tokens", "_total", kvtier_instance="a", reason="host_capacity") == 8
    assert value(m, "dropped_backup_tokens", "_total", kvtier_instance="a", reason="storage_write") == 16
    # one interval each: 5e8 B / 0.5 s = 1 GB/s read, 1e9 B / 2 s = 500 MB/s write
    read = "storage_read_bandwidth_bytes_per_second"
    write = "storage_write_bandwidth_bytes_per_second"
    assert value(m, read, "_count", kvtier_instance="a") == 1
    assert value(m, read, "_sum", kvtier_instance="a") == 1e9
    assert value(m, write, "_count", kvtier_instance="a") == 1
    assert value(m, write, "_sum", kvtier_instance="a") == 5e8


def test_zero_duration_transfers_are_not_observed():
    m = ServeMetrics()
    m.observe_storage_transfer("a", False, 1024, 0.0)
    m.observe_storage_transfer("a", False, 0, 1.0)
    assert value(m, "storage_read_bandwidth_bytes_per_second", "_count", kvtier_instance="a") == 0


def dashboard_queries() -> list[str]:
    """Every query of examples/grafana_dashboard.json (its panels' and the instance menu's)."""
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "grafana_dashboard.json"
    dashboard = json.loads(path.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    return exprs + [dashboard["templating"]["list"][1]["query"]]


def dashboard_series() -> set[str]:
    """The series names the dashboard's queries read."""
    import re

    used = {name for e in dashboard_queries() for name in re.findall(r"\bkvtier_[a-z0-9_]+", e)}
    return used - {"kvtier_instance"}  # the label


def test_the_grafana_dashboard_queries_only_exported_series():
    exported = ({f"kvtier_{n}_total" for n in COUNTERS} | {f"kvtier_{n}" for n in GAUGES}
                | {f"kvtier_{n}_{s}" for n in HISTOGRAMS for s in ("bucket", "count", "sum")})
    used = dashboard_series()
    assert used and used <= exported, sorted(used - exported)
    # every query can filter by instance
    assert all("kvtier_instance" in e for e in dashboard_queries())
    # What it names is what a deployment renders (the private registry, fed once).
    m = ServeMetrics()
    m.observe_request("a", 0.2, 0.01, CachedTokens(1, 0, 0), "stop", 10, 2, 0.3)
    rendered = {s.name for f in families(m).values() for s in f.samples}
    assert {"kvtier_prompt_tokens_total", "kvtier_ttft_seconds_bucket"} <= rendered


def test_a_snapshot_key_no_counters_type_declares_is_an_error():
    """A renamed or new counter must be declared (and exported) on purpose, not vanish."""
    m = ServeMetrics()
    with pytest.raises(MetricsError, match="renamed_tokens"):
        m.update_cache("a", cache_snapshot(lookups=1) | {"renamed_tokens": 3}, 0, 10)
    with pytest.raises(MetricsError, match="bogus"):
        m.update_cache("a", cache_snapshot(), 0, 10, StorageCounters().snapshot() | {"bogus": 1})
    with pytest.raises(MetricsError, match="bogus"):
        m.update_namespace("ns-1", {"evicted_pages": 1, "bogus": 2})
    # every field of the merged counters types is known (what the rank actor sends)
    full = (CacheCounters().snapshot() | TransferStats()._asdict()
            | RetractionCounters().snapshot() | RankFaults().snapshot())
    m.update_cache("a", full, 0, 10, StorageCounters().snapshot() | {
        k: v for k, v in dataclasses.asdict(BackendStats()).items() if k != "extra"})


def test_a_source_of_a_missing_field_fails_when_made():
    """What the import-time check of the sources relies on: a field renamed in its counters
    dataclass (or a typo in a source) stops the module from importing."""
    with pytest.raises(MetricsError, match="CacheCounters has no field"):
        _src("lookups", CacheCounters, "lookup_count")
    with pytest.raises(MetricsError, match="no such counter family"):
        check_sources((_src("not_a_family", CacheCounters, "lookups"),), CACHE_COUNTERS)
    with pytest.raises(MetricsError, match="does not merge"):
        check_sources((_src("lookups", StorageCounters, "queried_tokens"),), CACHE_COUNTERS)
    for src in CACHE_SOURCES + STORAGE_SOURCES:
        assert set(src.keys) <= set(field_names(src.counters)), src
