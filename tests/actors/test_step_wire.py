"""Step reports and outputs cross the actor boundary as msgpack: a round trip keeps every
field, and a bad payload is a MessageError."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest

from kvtier.actors.step_wire import (Progress, StepReport, decode_output, decode_report,
                                     encode_output, encode_report, encode_sampling)
from kvtier.engine.request import CachedTokens, FinishReason, Output
from kvtier.engine.sampling import TokenLogprob
from kvtier.messages import MessageError
from kvtier.tiers.cache_types import RequestLengths

OUT = Output(7, (1, 2, 3), (4, 5), None, FinishReason.STOP, RequestLengths(16, 0, 0, 0, 3),
             CachedTokens(16, 0, 0), 0.25, 40.0, queue_s=0.125)


def test_round_trips():
    logprobs = (TokenLogprob(4, -0.5, ((4, -0.5), (6, -1.25))), TokenLogprob(5, -0.125, ()))
    with_logprobs = dataclasses.replace(OUT, logprobs=logprobs)
    failed = dataclasses.replace(OUT, finish_reason=FinishReason.ERROR, error="it failed")
    report = StepReport((OUT, with_logprobs, failed),
                        {3: Progress(0, (9, 8)), 4: Progress(5, (4,), logprobs[:1])},
                        b"\x01events")
    assert decode_report(encode_report(report)) == report
    assert decode_output(encode_output(OUT)) == OUT
    assert decode_output(encode_output(with_logprobs)).logprobs == logprobs
    assert decode_output(encode_output(None)) is None
    empty = StepReport((), {}, None)
    assert decode_report(encode_report(empty)) == empty


def _report_map(**fields):
    return {"type": "StepReport", "finished": [], "progress": {}, "events": None, **fields}


@pytest.mark.parametrize("payload", [
    b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"finished": [], "progress": []}),
    msgpack.packb(_report_map(finished=[{"type": "Output", "request_id": 1}])),
    msgpack.packb(_report_map(progress={"x": {"type": "Progress", "start": 0, "tokens": [1]}})),
    msgpack.packb(_report_map(progress={1: {"type": "Progress", "start": "x", "tokens": [1]}})),
    msgpack.packb(_report_map(progress={1: [0, [1], None]})),  # the old positional form
    msgpack.packb(_report_map(events="text")),
    msgpack.packb(_report_map(handoffs=[[1, ["h", True]]])),
    msgpack.packb(_report_map(surplus=1)),
])
def test_bad_payloads_are_message_errors(payload):
    with pytest.raises(MessageError):
        decode_report(payload)


def test_the_rank_boundary_records_round_trip():
    """What goes to a rank (sampling, resume, hand-off targets, received KV) and what comes
    back (a hand-off in a step report) are checked records, not pickles or positional lists."""
    from kvtier.actors.step_wire import decode_resume, decode_sampling, encode_resume
    from kvtier.engine.handoff import HandoffSent, HandoffTarget, IncomingKV, Staging
    from kvtier.engine.request import Resume
    from kvtier.engine.sampling import SamplingParams
    from kvtier.messages import pack_record, unpack_record

    for params in (SamplingParams(), SamplingParams(stop_token_ids=()),
                   SamplingParams(7, 0.5, 0.9, (2, 3), 11, 40, 0.1, 1.1, 0.5, -0.5, 5)):
        assert decode_sampling(encode_sampling(params)) == params
    lp = TokenLogprob(4, -0.5, ((4, -0.5), (6, -1.25)))
    assert decode_resume(encode_resume(Resume((4, 5), (lp, lp)))) == Resume((4, 5), (lp, lp))
    assert encode_resume(None) is None and decode_resume(None) is None
    target = HandoffTarget("h1", b"\x00peer", 1 << 40, 64, (3, 4), 12.5, (0, 2),
                           Staging(1 << 41, 32, (7, 8)))
    for record in (target, target._replace(staging=None), IncomingKV("h1", (), (), 9),
                   IncomingKV("h1", (3, 4), (1 << 63, 2), 9, lp, (7,))):
        assert unpack_record(type(record), pack_record(record)) == record
    sent = HandoffSent("h1", True, (1, 2), 4096, 8, 0.25, "", (0, 2), False)
    report = StepReport((), {}, None, ((3, sent),))
    assert decode_report(encode_report(report)) == report
    with pytest.raises(MessageError, match="SamplingParams"):
        decode_sampling(msgpack.packb({"type": "SamplingParams", "max_new_tokens": 0}))
    with pytest.raises(MessageError, match="HandoffTarget.pages"):
        unpack_record(HandoffTarget, msgpack.packb({**pack_map(target), "pages": ["x"]}))


def test_listings_and_counters_cross_as_records():
    """A rank's pins and hand-off counters, and an L3 namespace's pins, are checked records
    (they were dicts read by key)."""
    from kvtier.actors.pd.rank_port import RankTransportCounters
    from kvtier.backends.transport_base import TransportCounters
    from kvtier.engine.handoff_desk import DeskCounters
    from kvtier.engine.handoff_intake import IntakeCounters
    from kvtier.messages import pack_record, pack_records, unpack_record, unpack_records
    from kvtier.policies import Transport
    from kvtier.tiers.cache_pins import PinListing
    from kvtier.tiers.page_pins import L3PinListing

    idle = RankTransportCounters(DeskCounters(0, 0, 0, 0, 0), IntakeCounters(0, 0, 0, 0), 0, 0, 0,
                                 0, None, None)
    busy = idle._replace(reserved_pages=3, transport=Transport.NIXL,
                         transfers=TransportCounters(4096, 8, 1, 0))
    for record in (idle, busy):
        assert unpack_record(RankTransportCounters, pack_record(record)) == record
    pins = [PinListing("p", "acme", 3, 2.5, 1, 3), PinListing("q", "", 1, 0.0, 0, 1)]
    assert unpack_records(PinListing, pack_records(pins)) == pins
    assert unpack_records(L3PinListing, pack_records([])) == []
    with pytest.raises(MessageError, match="L3PinListing"):
        unpack_records(L3PinListing, pack_records(pins))
    with pytest.raises(MessageError, match="list of PinListing"):
        unpack_records(PinListing, pack_record(pins[0]))


def pack_map(record):
    from kvtier.messages import record_to_map
    return record_to_map(record)


def test_progress_after_what_a_caller_has():
    lps = (TokenLogprob(4, -0.5, ()), TokenLogprob(5, -1.0, ()), TokenLogprob(6, -2.0, ()))
    p = Progress(3, (4, 5, 6), lps)
    assert p.stop == 6
    assert p.after(3) == p and p.after(0) == p
    assert p.after(4) == Progress(4, (5, 6), lps[1:])
    assert p.after(6) is None and p.after(9) is None
    assert Progress(0, (1, 2)).after(1) == Progress(1, (2,), None)


def test_resume_round_trips():
    """A resume (frontend/redispatch.py builds it, the serve replica takes it) decodes checked."""
    from kvtier.actors.step_wire import decode_resume, encode_resume
    from kvtier.engine.request import Resume
    from kvtier.messages import record_to_map

    r = Resume((4, 5), (TokenLogprob(4, -0.5, ((4, -0.5),)), TokenLogprob(5, -0.1, ())))
    assert decode_resume(encode_resume(r)) == r
    assert decode_resume(encode_resume(Resume((1,)))) == Resume((1,))
    assert decode_resume(encode_resume(None)) is None
    bad = {**record_to_map(r), "tokens": ["x"]}
    with pytest.raises(MessageError):
        decode_resume(msgpack.packb(bad))


def test_a_step_report_does_not_grow_with_the_answer():
    """Rank 0 reports each answer token once: with 16 answers asking for 20 alternatives per
    token, a decode step's report stays the size of one step's tokens, however long the
    answers are (it used to carry every answer whole at every step: O(T^2) per answer)."""
    import torch

    from kvtier.actors.rank_actor import Rank, RankSettings
    from kvtier.config import HiCacheConfig
    from kvtier.engine.sampling import SamplingParams
    from kvtier.engine.weight_sources import TinyWeights

    settings = RankSettings(TinyWeights(seed=1), HiCacheConfig(page_size=16), device_pages=128,
                            dtype=torch.float32, chunk_tokens=64)
    rank = Rank(0, 1, "", settings)
    try:
        params = SamplingParams(max_new_tokens=120, temperature=1.0, seed=3, logprobs=20,
                                stop_token_ids=())
        for i in range(16):
            rank.add_request([1 + i, 2, 3, 4, 5], encode_sampling(params))
        sizes, seen = [], {}
        for _ in range(400):
            data = rank.step()
            report = decode_report(data)
            for rid, p in report.progress.items():
                assert p.start == seen.get(rid, 0)  # each token once
                seen[rid] = p.stop
            if report.finished:
                break
            if report.progress:
                sizes.append(len(data))
        assert max(seen.values()) >= 100
        assert max(sizes[5:]) < 2 * sizes[5], sizes  # flat, not growing with the answer
    finally:
        rank.close()


def test_a_pin_answer_is_a_tagged_record():
    """A rank's pin answer says by its record type whether it pinned or refused (no
    {"refused": ...} key protocol)."""
    from kvtier.actors.step_wire import decode_pin
    from kvtier.messages import pack_record
    from kvtier.tiers.cache_pins import PinOutcome, PinRefusal

    made, refused = PinOutcome("p", 3, 2, 1, 60.0), PinRefusal(4, 1, "over the pin budget")
    assert decode_pin(pack_record(made)) == made
    assert decode_pin(pack_record(refused)) == refused
    with pytest.raises(MessageError):
        decode_pin(msgpack.packb({"refused": refused._asdict()}))
