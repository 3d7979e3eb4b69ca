"""The serve graph's records (`kvtier.frontend.records`): what crosses between deployments is
msgpack, decoded and checked at the receiver, and the HTTP JSON built from it is the shape
the dicts of before gave."""
from __future__ import annotations

import msgpack
import pytest

from kvtier.engine.handoff import HandoffStages
from kvtier.engine.request import CachedTokens, FinishReason
from kvtier.engine.sampling import TokenLogprob
from kvtier.messages import MessageError
from kvtier.frontend import openai_responses as out
from kvtier.frontend.records import (AnswerFinal, AnswerItem, AnswerItemKind, ExpectedPages,
                                     PDReport, ReplicaDescription, ReplicaPoll, Route)
from kvtier.frontend.router_index import Choice, ChoiceReason, TierHits
from kvtier.tiers.cache_types import RequestLengths


class Output:
    """What a finished request's output carries for its final item."""

    finish_reason = FinishReason.STOP
    cached = CachedTokens(64, 16, 0)
    lengths = RequestLengths(64, 16, 16, 0, 12)
    ttft_s = 0.125
    queue_s = None


def pd_report() -> PDReport:
    stages = HandoffStages(0.001, 0.2, None, 0.0301234567, None)
    return out.pd_report("handoff", "mooncake", "prefill-0", None, stages, 4096, 2)


def roundtrip(record):
    return type(record).from_msgpack(record.to_msgpack())


def test_every_record_comes_back_equal():
    final = AnswerFinal.of(Output(), "instance-1", pd_report())
    items = [AnswerItem.more([1, 2], [TokenLogprob(1, -0.5, ((1, -0.5), (7, -2.0)))]),
             AnswerItem(AnswerItemKind.FINAL, (3,), None, final),
             AnswerItem(AnswerItemKind.ERROR, (), error="sampling failed")]
    records = [*items, Route.of(Choice("instance-1", ChoiceReason.TIE, TierHits(2, 1, 0), 3.0)),
               Route(None), ReplicaPoll(3, 1, (b"\x01\x02",), None, 17, True),
               ReplicaPoll(0, 0, (), "it broke", 0)]
    for record in records:
        assert roundtrip(record) == record


def test_the_http_fields_are_the_dicts_of_before():
    """`kvtier.cached_tokens`, `lengths`, `pd` and `route` of an answer, key for key and in
    order, as the replica's and the router's dicts made them."""
    report = roundtrip(pd_report())
    final = roundtrip(AnswerFinal.of(Output(), "instance-1", report))
    stages = HandoffStages(0.001, 0.2, None, 0.0301234567, None)
    assert final.cached == Output.cached and type(final.cached) is type(Output.cached)
    assert final.lengths == Output.lengths and type(final.lengths) is type(Output.lengths)
    expected_pd = {"mode": "handoff", "transport": "mooncake", "prefill_instance": "prefill-0",
                   "decode_instance": None, "stages": {"bootstrap_s": 0.001, "prefill_s": 0.2,
                                                       "transfer_s": None, "kv_ready_s": 0.030123,
                                                       "decode_queue_s": None},
                   "transfer_bytes": 4096, "transfer_pages": 2}
    assert list(final.pd.to_dict().items()) == list(expected_pd.items())
    assert out.kvtier_field(final.cached, final.lengths, final.pd) == {
        "cached_tokens": Output.cached._asdict(), "lengths": Output.lengths._asdict(),
        "pd": expected_pd}
    assert final.finish_reason.value == "stop" and final.instance == "instance-1"
    route = roundtrip(Route.of(Choice("a", ChoiceReason.BEST_HIT, TierHits(2, 1, 0), 0.2)))
    assert route.to_field() == {"reason": "best_hit", "expected_pages": {
        "device_pages": 2, "host_pages": 1, "storage_pages": 0, "peer_pages": 0}}


def test_an_item_says_what_it_is():
    """A final item carries `final`, an error item its reason, a token item neither: no
    item can be both (what `"error" in item` used to guess)."""
    final = AnswerFinal.of(Output(), "a")
    with pytest.raises(MessageError, match="final"):
        AnswerItem(AnswerItemKind.FINAL, (1,))
    with pytest.raises(MessageError, match="final"):
        AnswerItem(AnswerItemKind.TOKENS, (1,), final=final)
    with pytest.raises(MessageError, match="error"):
        AnswerItem(AnswerItemKind.ERROR, (1,))
    with pytest.raises(MessageError, match="error"):
        AnswerItem(AnswerItemKind.FINAL, (1,), final=final, error="both")
    assert not AnswerItem.more([1]).last
    assert AnswerItem(AnswerItemKind.ERROR, (), error="x").last


def test_a_bad_payload_is_refused_at_the_receiver():
    good = AnswerItem.more([1, 2]).to_map()
    for bad, match in [({**good, "tokens": [1, "2"]}, r"tokens\[1\]"),
                       ({**good, "kind": "done"}, "not one of"),
                       ({**good, "logprobs": [{"a": 1}]}, "TokenLogprob"),
                       ({**good, "extra": 1}, "unknown field")]:
        with pytest.raises(MessageError, match=match):
            AnswerItem.from_msgpack(msgpack.packb(bad, use_bin_type=True))
    with pytest.raises(MessageError, match="expected a Route record"):
        Route.from_msgpack(AnswerItem.more([1]).to_msgpack())
    poll = ReplicaPoll(1, 0, (b"x",), None, 1).to_map()
    with pytest.raises(MessageError, match="events"):
        ReplicaPoll.from_msgpack(msgpack.packb({**poll, "events": ["x"]}, use_bin_type=True))


def test_a_description_gives_the_key_namespace():
    desc = roundtrip(ReplicaDescription("m", "", "f", 16, "instance-0", 1))
    assert desc.key_namespace.model == "m" and desc.page_size == 16
    assert ExpectedPages(1, 2, 3).to_dict() == {"device_pages": 1, "host_pages": 2,
                                                "storage_pages": 3, "peer_pages": 0}


def test_the_router_status_and_the_storage_show_as_before():
    """GET /admin/router's and /admin/storage's JSON: instances by name, fields in order."""
    from kvtier.policies import StorageBackendKind
    from kvtier.frontend.liveness import InstanceState
    from kvtier.frontend.records import (InstanceStatus, L3Attachment, ReplicaStorage,
                                         RouterStatus)

    status = roundtrip(RouterStatus(
        (InstanceStatus("a", 2, None, None, 5, 10, InstanceState.LIVE, 0.25, 0),
         InstanceStatus("b", 0, 1, "poll failed: x", 1, 0, InstanceState.STALLED, 3.5, 1)),
        4, {"tie": 3, "best_hit": 2}))
    body = status.to_json()
    assert body == {"instances": {
        "a": {"load": 2, "epoch": None, "broken": None, "routed": 5, "indexed_pages": 10,
              "state": "live", "quiet_s": 0.25, "stalls": 0},
        "b": {"load": 0, "epoch": 1, "broken": "poll failed: x", "routed": 1,
              "indexed_pages": 0, "state": "stalled", "quiet_s": 3.5, "stalls": 1}},
        "storage_pages": 4, "reasons": {"tie": 3, "best_hit": 2}}
    assert list(body["instances"]["a"]) == ["load", "epoch", "broken", "routed",
                                            "indexed_pages", "state", "quiet_s", "stalls"]
    assert status.stalled() == {"b"}
    attached = roundtrip(ReplicaStorage("instance-0", L3Attachment(
        StorageBackendKind.FILE, "ns-1", {"root_dir": "/l3", "max_size_bytes": 1 << 30})))
    assert attached.to_dict() == {"instance": "instance-0", "l3": {
        "backend": "file", "namespace": "ns-1",
        "options": {"root_dir": "/l3", "max_size_bytes": 1 << 30}}}
    assert roundtrip(ReplicaStorage("instance-0", None)).to_dict() == {"instance": "instance-0",
                                                                       "l3": None}


def test_a_snapshot_feeds_the_metrics_after_its_trip():
    """What a replica's `snapshot` sends (every counters type's fields) reaches the metrics
    whole: a field no counters type declares would be a MetricsError."""
    import dataclasses

    from kvtier.actors.serve_snapshots import SnapshotFeed
    from kvtier.backends.base import BackendStats
    from kvtier.engine.retraction import RetractionCounters
    from kvtier.frontend.metrics import RankFaults, ServeMetrics
    from kvtier.frontend.records import InstanceSnapshot, ReplicaSnapshot
    from kvtier.tiers.cache_types import CacheCounters
    from kvtier.tiers.controller import TransferStats
    from kvtier.tiers.storage_types import StorageCounters

    counters = (CacheCounters(lookups=3).snapshot() | TransferStats(load_s=0.5)._asdict()
                | RetractionCounters().snapshot() | RankFaults(rank_restarts=1).snapshot())
    backend = {k: v for k, v in dataclasses.asdict(BackendStats()).items() if k != "extra"}
    storage = StorageCounters(queried_tokens=32).snapshot() | backend
    snap = ReplicaSnapshot((InstanceSnapshot(
        "prefill-0", counters, storage, 16, 64, {"running_requests": 1}, (2e-5, 3e-5),
        {"pins": 1, "device_pages": 0, "host_pages": 2}, 1),))
    (got,) = roundtrip(snap).instances
    assert got == snap.instances[0]
    feed = object.__new__(SnapshotFeed)
    feed.metrics = ServeMetrics()
    feed._observe_snapshot(got)
    body = feed.metrics.render()[0].decode()
    assert 'kvtier_lookups_total{kvtier_instance="prefill-0"} 3.0' in body
    assert 'kvtier_rank_restarts_total{kvtier_instance="prefill-0"} 1.0' in body
    assert 'kvtier_prefetch_query_tokens_total{kvtier_instance="prefill-0"} 32.0' in body
