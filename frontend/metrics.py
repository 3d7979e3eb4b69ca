"""Prometheus metrics of a serving deployment, fed from plain snapshots.

The caches keep monotonic counters (`CacheCounters.snapshot()`, `StorageCounters.snapshot()`,
the controller's `TransferStats`, the backend's `BackendStats`, the scheduler's
`RetractionCounters`, the instance's `RankFaults`) and ship them as dicts of their fields;
this module turns successive snapshots into Prometheus counter increments. Each source names
the counters type whose field it reads, checked at import, and a snapshot key that no type
declares is an error (never silently dropped). It is free of Ray: the serve graph polls the
instances and hands the dicts over here.

All families live on a private `CollectorRegistry`, so two deployments (or two tests) in one
process never collide, and every family carries a `kvtier_instance` label (not `instance`,
which Prometheus sets to the scrape target and would rename ours `exported_instance`). A
snapshot whose counter went backwards means the instance restarted: its new value is the
increment since then.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from kvtier.backends.base import BackendStats
from kvtier.engine.request import CachedTokens
from kvtier.engine.retraction import RetractionCounters
from kvtier.errors import KvtierError
from kvtier.messages import DirectoryStats
from kvtier.tiers.cache_types import CacheCounters
from kvtier.tiers.controller import TransferStats
from kvtier.tiers.storage_types import StorageCounters

PREFIX = "kvtier_"
LABEL = "kvtier_instance"  # the serving instance a series belongs to

# µs-scale: one MIN all-reduce per scheduling step should cost tens of microseconds
AGREEMENT_BUCKETS_S = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2,
                       2.5e-2, 0.1, 1.0)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# 1 MB/s .. 100 GB/s: file backends on a slow disk up to RDMA-backed Mooncake
BANDWIDTH_BUCKETS_BPS = (1e6, 1e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 1e11)


@dataclass(frozen=True)
class RankFaults:
    """An instance's rank replacements, which join its rank 0's cache counters."""

    rank_restarts: int = 0  # times it replaced its rank actors after a fault
    rank_divergences: int = 0  # of those, the times its ranks had fallen out of step

    def snapshot(self) -> dict[str, int]:
        return dataclasses.asdict(self)


class MetricsError(KvtierError):
    """A snapshot or a metric source that does not match the typed counters it reads."""


class Source(NamedTuple):
    """One counter family's increment = sum of the deltas of `keys` in one snapshot: fields
    of the counters type `counters` (checked when the source is made)."""

    family: str
    labels: tuple[tuple[str, str], ...]
    keys: tuple[str, ...]
    counters: type


def field_names(counters: type) -> tuple[str, ...]:
    """The counter fields of a counters dataclass or NamedTuple (BackendStats' free-form
    `extra` is not one)."""
    if dataclasses.is_dataclass(counters):
        names = tuple(f.name for f in dataclasses.fields(counters))
    else:
        names = tuple(counters._fields)
    return tuple(n for n in names if n != "extra")


def _src(family: str, counters: type, keys: str | tuple[str, ...], **labels: str) -> Source:
    """A source of `family` reading field(s) `keys` of `counters`; MetricsError (raised at
    import) when one is not a field of it."""
    keys = (keys,) if isinstance(keys, str) else keys
    missing = [k for k in keys if k not in field_names(counters)]
    if missing:
        raise MetricsError(f"metric family {family!r} reads {missing}, which "
                           f"{counters.__name__} has no field for: name the field in the "
                           "source (or give the field its old name back)")
    return Source(family, tuple(labels.items()), keys, counters)


# What a cache snapshot's `counters` merge (actors/rank_actor.py cache_snapshot, and the
# instance's RankFaults): every key must be a field of one of them
CACHE_COUNTERS = (CacheCounters, TransferStats, RetractionCounters, RankFaults)
# What a storage snapshot merges: the L3 counters and the backend's stats
STORAGE_COUNTERS = (StorageCounters, BackendStats)

CACHE_SOURCES = (
    _src("lookups", CacheCounters, "lookups"),
    _src("hit_tokens", CacheCounters, "device_hit_tokens", tier="device"),
    _src("hit_tokens", CacheCounters, "host_hit_tokens", tier="host"),
    _src("evicted_tokens", CacheCounters, "evicted_device_tokens", tier="device"),
    _src("evicted_tokens", CacheCounters, "evicted_host_tokens", tier="host"),
    _src("load_back_tokens", CacheCounters, "loaded_back_tokens"),
    _src("load_back_bytes", TransferStats, "load_bytes"),
    _src("load_back_seconds", TransferStats, "load_s"),
    # L1 -> L2 copies: write-through backups and write-back on eviction
    _src("backup_tokens", CacheCounters, ("backed_up_tokens", "written_back_tokens")),
    _src("backup_bytes", TransferStats, "write_bytes"),
    _src("backup_seconds", TransferStats, "write_s"),
    _src("dropped_backup_tokens", CacheCounters, "dropped_backup_tokens",
         reason="host_capacity"),
    _src("load_back_refused_tokens", CacheCounters, "unloaded_below_threshold_tokens",
         reason="below_threshold"),
    _src("load_back_refused_tokens", CacheCounters, "unloaded_over_quota_tokens",
         reason="over_quota"),
    _src("load_back_refused_tokens", CacheCounters, "unloaded_device_capacity_tokens",
         reason="device_capacity"),
    _src("rank_restarts", RankFaults, "rank_restarts"),
    _src("rank_divergences", RankFaults, "rank_divergences"),
    # the scheduler's RetractionCounters, merged into the rank's counters
    _src("retractions", RetractionCounters, "retracted_requests", outcome="retracted"),
    _src("retractions", RetractionCounters, "restored_requests", outcome="restored"),
    _src("retractions", RetractionCounters, "retract_fallbacks", outcome="recomputed"),
)

STORAGE_SOURCES = (
    _src("hit_tokens", StorageCounters, "storage_hit_tokens", tier="storage"),
    _src("prefetch_query_tokens", StorageCounters, "queried_tokens"),
    _src("prefetch_hit_tokens", StorageCounters, "prefetched_tokens"),
    _src("prefetch_wait_seconds", StorageCounters, "prefetch_wait_s"),
    _src("prefetch_unfulfilled_tokens", StorageCounters, "unfulfilled_below_threshold_tokens",
         reason="below_threshold"),
    _src("prefetch_unfulfilled_tokens", StorageCounters, "unfulfilled_host_capacity_tokens",
         reason="host_capacity"),
    _src("prefetch_unfulfilled_tokens", StorageCounters, "unfulfilled_storage_transfer_tokens",
         reason="storage_transfer"),
    _src("storage_backup_tokens", StorageCounters, "backed_up_tokens"),
    _src("dropped_backup_tokens", StorageCounters, "backup_failed_tokens", reason="storage_write"),
    _src("storage_read_bytes", BackendStats, "bytes_read"),
    _src("storage_write_bytes", BackendStats, "bytes_written"),
    _src("directory_errors", StorageCounters, "directory_errors"),
    _src("l3_directory_misses", StorageCounters, "directory_miss_lookups"),
    _src("storage_errors", StorageCounters, "lookup_errors", op="lookup"),
    _src("storage_errors", BackendStats, "write_failures", op="write"),
    _src("storage_corrupt_objects", BackendStats, "corrupt_objects"),
)

COUNTERS = {  # family -> (help, extra label names)
    "cached_tokens": ("Prompt tokens served from cache, by the tier they came from", ("tier",)),
    "requests": ("Finished requests by finish reason", ("finish_reason",)),
    "prompt_tokens": ("Prompt tokens of finished requests", ()),
    "generation_tokens": ("Tokens generated for finished requests", ()),
    "lookups": ("Cache lookups (one per request per rank)", ()),
    "hit_tokens": ("Tokens the cache found per tier at lookup time", ("tier",)),
    "evicted_tokens": ("Tokens evicted from a tier", ("tier",)),
    "load_back_tokens": ("Tokens loaded back L2 -> L1", ()),
    "load_back_bytes": ("Bytes loaded back L2 -> L1", ()),
    "load_back_seconds": ("Copy time of L2 -> L1 load-backs", ()),
    "backup_tokens": ("Tokens copied L1 -> L2 (write-through and write-back)", ()),
    "backup_bytes": ("Bytes copied L1 -> L2", ()),
    "backup_seconds": ("Copy time of L1 -> L2 backups", ()),
    "dropped_backup_tokens": ("Tokens whose backup was dropped, by reason", ("reason",)),
    "load_back_refused_tokens": ("L2 hits recomputed instead of loaded back, by reason",
                                 ("reason",)),
    "prefetch_query_tokens": ("Tokens asked of L3 by prefetches", ()),
    "prefetch_hit_tokens": ("Tokens prefetched from L3 that landed in L2 and were used", ()),
    "prefetch_wait_seconds": ("Time from prefetch submission to completion", ()),
    "prefetch_unfulfilled_tokens": ("L3 tokens not prefetched, by reason", ("reason",)),
    "storage_backup_tokens": ("Tokens written L2 -> L3", ()),
    "storage_read_bytes": ("Bytes read from L3", ()),
    "storage_write_bytes": ("Bytes written to L3", ()),
    "directory_errors": ("Failed calls to the L3 page directory", ()),
    "l3_directory_misses": ("L3 lookups answered as misses because the namespace's page "
                            "directory could not answer (its actor down or restarting, the "
                            "namespace lost)", ()),
    "storage_errors": ("Failed L3 backend calls (each a miss or a dropped write), by op",
                       ("op",)),
    "storage_corrupt_objects": ("L3 objects that failed their check on read (and were "
                                "removed)", ()),
    "retractions": ("Decoding requests moved out of a full L1: retracted to L2, restored "
                    "from it, or recomputed where L2 had no room", ("outcome",)),
    "rank_restarts": ("Times an instance replaced its rank actors after a fault", ()),
    "rank_divergences": ("Of those, the times its ranks had fallen out of step (their "
                         "agreement saw different queues)", ()),
    "instance_stalls": ("Times the router declared an instance stalled (work waiting and no "
                        "step, or no poll answered, for the stall timeout)", ()),
    "redispatched_requests": ("Requests re-sent to another instance because this one "
                              "stalled while answering them", ()),
}

HISTOGRAMS = {  # family -> (help, buckets)
    "ttft_seconds": ("Time to first token", TTFT_BUCKETS_S),
    "tpot_seconds": ("Time per output token after the first", TPOT_BUCKETS_S),
    "e2e_request_seconds": ("Time from a request's arrival to its last token", E2E_BUCKETS_S),
    "queue_seconds": ("Time a request waited in its instance's queue before it was first "
                      "admitted", E2E_BUCKETS_S),
    "agreement_seconds": ("One cross-rank agreement round", AGREEMENT_BUCKETS_S),
    "storage_read_bandwidth_bytes_per_second": ("L3 read bandwidth per transfer or interval",
                                                BANDWIDTH_BUCKETS_BPS),
    "storage_write_bandwidth_bytes_per_second": ("L3 write bandwidth per transfer or interval",
                                                 BANDWIDTH_BUCKETS_BPS),
}

GAUGES = {
    "host_used_tokens": "Tokens held in the L2 host pool",
    "host_total_tokens": "Capacity of the L2 host pool in tokens",
    "device_used_tokens": "Tokens held in the L1 device pool (cached and in use)",
    "device_total_tokens": "Capacity of the L1 device pool in tokens",
    "running_requests": "Requests admitted and computing (prefill or decode)",
    "waiting_requests": "Requests queued for admission",
    "instance_stalled": "1 while the router holds the instance stalled, else 0",
    "pins": "Pinned prefixes the instance holds (POST /admin/pin)",
}
PIN_TIERS = ("device", "host")  # where an instance's pinned pages are (L3's: l3_pinned_pages)
TIER_GAUGES = {  # gauges with a `tier` label too
    "pinned_pages": "Pages of pinned prefixes an instance holds, by the tier they are in now "
                    "(pins keep them in host memory; device copies come and go)",
}

# The L3 namespace, which the deployment's instances share: its directory's figures
# (DirectoryStats keys), labelled by namespace rather than by instance.
NAMESPACE_LABEL = "namespace"
NAMESPACE_COUNTERS = {  # family -> (help, DirectoryStats key)
    "l3_evicted_pages": ("Pages the L3 namespace evicted to stay within its bound (l3_max_gb), "
                         "least recently used first", "evicted_pages"),
    "l3_old_format_pages_reclaimed": ("Pages of an old object format (named by TP rank) the L3 "
                                      "namespace found in its storage and deleted; they are "
                                      "never read", "old_format_pages_reclaimed"),
    "l3_purged_pages": ("Pages deleted from the L3 namespace by POST /admin/purge",
                        "purged_pages"),
}
NAMESPACE_GAUGES = {  # family -> (help, DirectoryStats key)
    "l3_published_pages": ("Pages the L3 namespace holds for every instance to hit",
                           "published_pages"),
    "l3_capacity_pages": ("The L3 namespace's bound in pages (0: unbounded)", "capacity_pages"),
    "l3_pins": ("Pinned prefixes the L3 namespace keeps", "pins"),
    "l3_pinned_pages": ("Pages pins keep in the L3 namespace whatever its bound", "pinned_pages"),
}

# (bytes key, seconds keys tried in order) for the interval bandwidth of a storage snapshot;
# prefetch_wait_s includes queueing, so it is only the fallback for reads
READ_TIMING = ("bytes_read", ("read_s", "prefetch_wait_s"))
WRITE_TIMING = ("bytes_written", ("write_s",))


def known_keys(counters: Sequence[type]) -> frozenset[str]:
    return frozenset(name for c in counters for name in field_names(c))


def check_sources(sources: Sequence[Source], counters: Sequence[type]) -> None:
    """Every source's family is exported and reads a type of `counters`; MetricsError if not
    (run at import, below)."""
    for src in sources:
        if src.family not in COUNTERS:
            raise MetricsError(f"source of {src.family!r}: no such counter family in COUNTERS")
        if src.counters not in counters:
            raise MetricsError(f"source of {src.family!r} reads {src.counters.__name__}, which "
                               "this snapshot does not merge")


def _check_tables() -> None:
    check_sources(CACHE_SOURCES, CACHE_COUNTERS)
    check_sources(STORAGE_SOURCES, STORAGE_COUNTERS)
    storage = known_keys(STORAGE_COUNTERS)
    for key in (READ_TIMING[0], *READ_TIMING[1], WRITE_TIMING[0], *WRITE_TIMING[1]):
        if key not in storage:
            raise MetricsError(f"storage timing key {key!r} is no field of StorageCounters "
                               "or BackendStats")
    directory = known_keys((DirectoryStats,))
    for name, (_, key) in {**NAMESPACE_COUNTERS, **NAMESPACE_GAUGES}.items():
        if key not in directory:
            raise MetricsError(f"namespace family {name!r} reads {key!r}, no field of "
                               "DirectoryStats")


_check_tables()
CACHE_KEYS = known_keys(CACHE_COUNTERS)
STORAGE_KEYS = known_keys(STORAGE_COUNTERS)
NAMESPACE_KEYS = known_keys((DirectoryStats,))


def _check_keys(snapshot: Mapping[str, float], known: frozenset[str], what: str) -> None:
    unknown = sorted(set(snapshot) - known)
    if unknown:
        raise MetricsError(f"{what} snapshot has key(s) {unknown} that no counters type of "
                           "frontend/metrics.py declares: add the field to its counters "
                           "dataclass (and a source if it is exported)")


def counter_deltas(last: Mapping[str, float] | None, now: Mapping[str, float]) -> dict[str, float]:
    """Increments between two monotonic snapshots of one source.

    If any counter went backwards the source restarted from zero, and then every counter of
    `now` is its increment: checking keys one by one would miss a counter that grew past its
    old value again before this snapshot.
    """
    now = {k: v for k, v in now.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    last = last or {}
    if any(v < last.get(k, 0) for k, v in now.items()):
        last = {}
    return {k: v - last.get(k, 0) for k, v in now.items()}


class ServeMetrics:
    """The deployment's metrics: observe requests and agreement rounds, feed cache snapshots,
    render the `/metrics` page."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._counters = {name: Counter(PREFIX + name, doc, (LABEL, *labels),
                                        registry=self.registry)
                          for name, (doc, labels) in COUNTERS.items()}
        self._histograms = {name: Histogram(PREFIX + name, doc, (LABEL,), buckets=buckets,
                                            registry=self.registry)
                            for name, (doc, buckets) in HISTOGRAMS.items()}
        self._gauges = {name: Gauge(PREFIX + name, doc, (LABEL,), registry=self.registry)
                        for name, doc in GAUGES.items()}
        self._namespace = {name: kind(PREFIX + name, doc, (NAMESPACE_LABEL,),
                                      registry=self.registry)
                           for kind, table in ((Counter, NAMESPACE_COUNTERS),
                                               (Gauge, NAMESPACE_GAUGES))
                           for name, (doc, _) in table.items()}
        self._gauges.update({name: Gauge(PREFIX + name, doc, (LABEL, "tier"),
                                         registry=self.registry)
                             for name, doc in TIER_GAUGES.items()})
        self._last: dict[tuple[str, str], dict[str, float]] = {}  # (instance, source) -> snapshot
        self._lock = threading.Lock()

    # ---- per request ---------------------------------------------------------------------
    def observe_request(self, instance: str, ttft_s: float, tpot_s: float | None,
                        cached: CachedTokens, finish_reason: str,
                        prompt_tokens: int = 0, generation_tokens: int = 0,
                        e2e_s: float | None = None, queue_s: float | None = None) -> None:
        """One finished request: its latencies, its tokens (cached ones by tier), its finish
        reason."""
        self._histograms["ttft_seconds"].labels(instance).observe(ttft_s)
        if tpot_s is not None:
            self._histograms["tpot_seconds"].labels(instance).observe(tpot_s)
        if e2e_s is not None:
            self._histograms["e2e_request_seconds"].labels(instance).observe(e2e_s)
        if queue_s is not None:
            self._histograms["queue_seconds"].labels(instance).observe(max(0.0, queue_s))
        self._counters["prompt_tokens"].labels(instance).inc(max(0, prompt_tokens))
        self._counters["generation_tokens"].labels(instance).inc(max(0, generation_tokens))
        for tier, tokens in cached._asdict().items():
            self._counters["cached_tokens"].labels(instance, tier).inc(max(0, tokens))
        self._counters["requests"].labels(instance, finish_reason).inc()

    def observe_agreement(self, instance: str, seconds_list: Sequence[float]) -> None:
        """Durations of agreement rounds (the scheduler reports them in batches)."""
        hist = self._histograms["agreement_seconds"].labels(instance)
        for seconds in seconds_list:
            hist.observe(seconds)

    def observe_storage_transfer(self, instance: str, write: bool, nbytes: int,
                                 seconds: float) -> None:
        """One L3 transfer's bandwidth, for callers that time each batch themselves."""
        if nbytes > 0 and seconds > 0:
            self._bandwidth(instance, write).observe(nbytes / seconds)

    def observe_redispatch(self, instance: str) -> None:
        """One request moved off `instance`, which stalled while answering it."""
        self._counters["redispatched_requests"].labels(instance).inc()

    # ---- snapshots -----------------------------------------------------------------------
    def update_liveness(self, instance: str, stalls: int, stalled: bool) -> None:
        """The router's view of one instance: its stall count so far and whether it is
        stalled now."""
        self._gauges["instance_stalled"].labels(instance).set(int(stalled))
        deltas = self._step(instance, "liveness", {"stalls": stalls})
        self._counters["instance_stalls"].labels(instance).inc(deltas["stalls"])
        # its series from the start, at 0 until a request is re-sent (graphs read no gap)
        self._counters["redispatched_requests"].labels(instance)

    def update_namespace(self, namespace: str, stats: Mapping[str, float]) -> None:
        """Fold one snapshot of the L3 namespace's directory figures (DirectoryStats) in."""
        _check_keys(stats, NAMESPACE_KEYS, "namespace")
        deltas = self._step(namespace, "namespace", {key: stats[key] for _, key in
                                                     NAMESPACE_COUNTERS.values() if key in stats})
        for name, (_, key) in NAMESPACE_COUNTERS.items():
            if key in deltas:
                self._namespace[name].labels(namespace).inc(deltas[key])
        for name, (_, key) in NAMESPACE_GAUGES.items():
            if key in stats:
                self._namespace[name].labels(namespace).set(stats[key])

    def update_pins(self, instance: str, pins: Mapping[str, int]) -> None:
        """One instance's pins: how many, and their pages by tier (`device_pages`,
        `host_pages`)."""
        self._gauges["pins"].labels(instance).set(pins.get("pins", 0))
        for tier in PIN_TIERS:
            self._gauges["pinned_pages"].labels(instance, tier).set(pins.get(f"{tier}_pages", 0))

    def update_gauges(self, instance: str, values: Mapping[str, float]) -> None:
        """Current values of one instance (pool use, queue lengths); names from GAUGES,
        unknown ones skipped."""
        for name, value in values.items():
            if name in GAUGES:
                self._gauges[name].labels(instance).set(value)

    def update_cache(self, instance: str, counters: Mapping[str, float], host_used_tokens: int,
                     host_total_tokens: int, storage: Mapping[str, float] | None = None) -> None:
        """Fold one instance's cache snapshot (and its L3 snapshot, if it has L3) into the
        counters. Missing keys are skipped, so partial snapshots still work; a key that is no
        field of the counters they merge (CACHE_COUNTERS, STORAGE_COUNTERS) is a
        MetricsError."""
        _check_keys(counters, CACHE_KEYS, "cache")
        if storage is not None:
            _check_keys(storage, STORAGE_KEYS, "storage")
        self._gauges["host_used_tokens"].labels(instance).set(host_used_tokens)
        self._gauges["host_total_tokens"].labels(instance).set(host_total_tokens)
        self._apply(instance, self._step(instance, "cache", counters), CACHE_SOURCES)
        if storage is not None:
            deltas = self._step(instance, "storage", storage)
            self._apply(instance, deltas, STORAGE_SOURCES)
            self._observe_interval_bandwidth(instance, deltas)

    def _step(self, instance: str, source: str, snapshot: Mapping[str, float]) -> dict[str, float]:
        """Deltas since this instance's previous snapshot of `source`; remembers this one."""
        with self._lock:
            deltas = counter_deltas(self._last.get((instance, source)), snapshot)
            self._last[(instance, source)] = dict(snapshot)
        return deltas

    def _apply(self, instance: str, deltas: Mapping[str, float], sources: Sequence[Source]) -> None:
        for src in sources:
            present = [deltas[k] for k in src.keys if k in deltas]
            if present:  # inc(0) too: the series shows up as soon as the source reports it
                labels = dict(src.labels, **{LABEL: instance})
                self._counters[src.family].labels(**labels).inc(sum(present))

    def _observe_interval_bandwidth(self, instance: str, deltas: Mapping[str, float]) -> None:
        """Bandwidth over the interval between two snapshots, when the snapshot has timings."""
        for write, (bytes_key, seconds_keys) in ((False, READ_TIMING), (True, WRITE_TIMING)):
            seconds = next((deltas[k] for k in seconds_keys if k in deltas), 0.0)
            self.observe_storage_transfer(instance, write, deltas.get(bytes_key, 0), seconds)

    def _bandwidth(self, instance: str, write: bool):
        kind = "write" if write else "read"
        return self._histograms[f"storage_{kind}_bandwidth_bytes_per_second"].labels(instance)

    # ---- exposition ----------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The `/metrics` body and its content type (Prometheus text format)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
