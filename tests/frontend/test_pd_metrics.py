"""A prefill/decode answer's `kvtier.pd` field, and the metrics fed from it: seconds per
stage, bytes and pages moved per transport, requests per mode."""
from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from kvtier.engine.handoff import HandoffStages
from kvtier.engine.request import CachedTokens
from kvtier.frontend import openai_responses as out
from kvtier.frontend.metrics import ServeMetrics
from kvtier.frontend.pd_metrics import MODES, STAGES, PDMetrics
from kvtier.frontend.records import PDReport
from kvtier.tiers.cache_types import RequestLengths

CACHED = CachedTokens(device=0, host=0, storage=32)
LENGTHS = RequestLengths(prefix_len=0, host_hit_length=32, host_loaded_length=32,
                        storage_hit_length=32, extend_len=16)


def handed_off(transfer_s: float = 0.002) -> PDReport:
    stages = HandoffStages(bootstrap_s=0.0004, prefill_s=0.05, transfer_s=transfer_s,
                           kv_ready_s=0.01, decode_queue_s=0.02)
    return out.pd_report("handoff", "nixl", "prefill-0", "decode-1", stages, 3 * 4096, 3)


def samples(m: ServeMetrics) -> dict:
    body, _ = m.render()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(body.decode()) for s in f.samples}


def test_the_field_says_how_the_request_went():
    pd = handed_off()
    assert pd.to_dict() == {"mode": "handoff", "transport": "nixl", "prefill_instance": "prefill-0",
                  "decode_instance": "decode-1", "transfer_bytes": 12288, "transfer_pages": 3,
                  "stages": {"bootstrap_s": 0.0004, "prefill_s": 0.05, "transfer_s": 0.002,
                             "kv_ready_s": 0.01, "decode_queue_s": 0.02}}
    field = out.kvtier_field(CACHED, LENGTHS, pd)
    assert field["pd"] == pd.to_dict() and field["lengths"] == LENGTHS._asdict()
    assert "pd" not in out.kvtier_field(CACHED, LENGTHS)  # instances that do both: as before
    mixed = out.pd_report("mixed", "nixl", "prefill-0", None, HandoffStages(bootstrap_s=0.001,
                                                                            prefill_s=0.2),
                          0, 0)
    json.dumps(mixed.to_dict(), allow_nan=False)  # stages that did not happen are null
    assert mixed.stages["transfer_s"] is None and mixed.decode_instance is None


def test_metrics_per_stage_transport_and_mode():
    m = ServeMetrics()
    pd = PDMetrics(m.registry, "pd", "nixl")
    before = samples(m)  # every transport and mode series exists at 0 before any request
    assert before[("kvtier_pd_transferred_bytes_total",
                   (("kvtier_instance", "pd"), ("transport", "nixl")))] == 0
    for mode in MODES:
        assert before[("kvtier_pd_requests_total",
                       (("kvtier_instance", "pd"), ("mode", mode)))] == 0
    pd.observe("pd", handed_off(transfer_s=0.002))
    pd.observe("pd", handed_off(transfer_s=3.0))  # a slow transfer stands out
    pd.observe("pd", out.pd_report("mixed", "nixl", "prefill-0", None,
                                   HandoffStages(bootstrap_s=0.001, prefill_s=0.2), 0, 0))
    got = samples(m)
    label = (("kvtier_instance", "pd"), ("transport", "nixl"))
    assert got[("kvtier_pd_transferred_bytes_total", label)] == 2 * 12288
    assert got[("kvtier_pd_transferred_pages_total", label)] == 6
    modes = {mode: got[("kvtier_pd_requests_total", (("kvtier_instance", "pd"), ("mode", mode)))]
             for mode in MODES}
    assert modes == {"handoff": 2, "recomputed": 0, "mixed": 1}
    counts = {stage: got[("kvtier_pd_stage_seconds_count",
                          (("kvtier_instance", "pd"), ("stage", stage)))] for stage in STAGES}
    assert counts == {"bootstrap": 3, "prefill": 3, "transfer": 2, "kv_ready": 2,
                      "decode_queue": 2}
    slow = ("kvtier_pd_stage_seconds_bucket",
            (("kvtier_instance", "pd"), ("le", "2.5"), ("stage", "transfer")))
    assert got[slow] == 1  # one transfer under 2.5 s, the other over
