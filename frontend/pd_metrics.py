"""Prometheus metrics of a prefill/decode graph, per finished request: how long each stage
took, what the hand-offs moved, and how requests went (handed off, recomputed, mixed).

Read beside the request's lengths, they tell a slow time to first token apart: a prompt its
prefill instance had to compute (an L3 miss: `storage_hit_length` 0, a long `extend_len`)
shows in the prefill stage, a slow hand-off in the transfer and KV-ready stages, a busy
decode instance in the decode queue. The families live on the deployment's `ServeMetrics`
registry and carry its `kvtier_instance` label.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvtier.engine.handoff import HandoffStages
from kvtier.frontend.metrics import LABEL, PREFIX
from kvtier.frontend.records import PDReport

STAGES = tuple(name.removesuffix("_s") for name in HandoffStages._fields)
MODES = ("handoff", "recomputed", "mixed")
# 100 µs (a reservation) .. 30 s (a long prompt's prefill behind a queue)
STAGE_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                   1.0, 2.5, 5.0, 10.0, 30.0)


class PDMetrics:
    """`observe(instance, pd)` with a response's `kvtier.pd` field."""

    def __init__(self, registry: CollectorRegistry, instance: str, transport: str) -> None:
        self._stages = Histogram(
            PREFIX + "pd_stage_seconds", "Seconds of each prefill/decode stage of a request: "
            "bootstrap (reserving decode memory), prefill (to the first token), transfer "
            "(the KV write), kv_ready (the decode side checking it), decode_queue (to the "
            "first decoded token)", (LABEL, "stage"), buckets=STAGE_BUCKETS_S,
            registry=registry)
        self._bytes = Counter(PREFIX + "pd_transferred_bytes", "KV bytes prefill instances "
                              "wrote into decode instances", (LABEL, "transport"),
                              registry=registry)
        self._pages = Counter(PREFIX + "pd_transferred_pages", "Prompt pages prefill "
                              "instances wrote into decode instances", (LABEL, "transport"),
                              registry=registry)
        self._requests = Counter(PREFIX + "pd_requests", "Finished prefill/decode requests "
                                 "by how they went: handoff (decoded over the sent KV), "
                                 "recomputed (the hand-off failed; the decode instance "
                                 "computed the prompt), mixed (no decode instance had room)",
                                 (LABEL, "mode"), registry=registry)
        # every series from the start, at 0 (graphs read no gap)
        self._bytes.labels(instance, transport)
        self._pages.labels(instance, transport)
        for mode in MODES:
            self._requests.labels(instance, mode)

    def observe(self, instance: str, pd: PDReport) -> None:
        """One finished request's `kvtier.pd` field (openai_responses.pd_report)."""
        for name, seconds in pd.stages.items():
            if seconds is not None:
                self._stages.labels(instance, name.removesuffix("_s")).observe(max(0.0, seconds))
        self._bytes.labels(instance, pd.transport).inc(max(0, pd.transfer_bytes))
        self._pages.labels(instance, pd.transport).inc(max(0, pd.transfer_pages))
        self._requests.labels(instance, pd.mode).inc()
