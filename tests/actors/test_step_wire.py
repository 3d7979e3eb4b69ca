"""Step reports and outputs cross the actor boundary as msgpack: a round trip keeps every
field, and a bad payload is a MessageError."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest

from kvtier.actors.step_wire import (Progress, StepReport, decode_output, decode_report,
                                     encode_output, encode_report)
from kvtier.engine.request import CachedTokens, FinishReason, Output
from kvtier.engine.sampling import TokenLogprob
from kvtier.messages import MessageError
from kvtier.tiers.cache_types import RequestLengths

OUT = Output(7, (1, 2, 3), (4, 5), None, FinishReason.STOP, RequestLengths(16, 0, 0, 0, 3),
             CachedTokens(16, 0, 0), 0.25, 40.0, queue_s=0.125)


def test_round_trips():
    logprobs = (TokenLogprob(4, -0.5, ((4, -0.5), (6, -1.25))), TokenLogprob(5, -0.125, ()))
    with_logprobs = dataclasses.replace(OUT, logprobs=logprobs)
    report = StepReport([OUT, with_logprobs], {3: Progress((9, 8)), 4: Progress((4,), logprobs[:1])},
                        b"\x01events")
    assert decode_report(encode_report(report)) == report
    assert decode_output(encode_output(OUT)) == OUT
    assert decode_output(encode_output(with_logprobs)).logprobs == logprobs
    assert decode_output(encode_output(None)) is None
    empty = StepReport([], {}, None)
    assert decode_report(encode_report(empty)) == empty


@pytest.mark.parametrize("payload", [
    b"\xc1", msgpack.packb([1, 2]), msgpack.packb({"finished": [], "progress": []}),
    msgpack.packb({"finished": [{"id": 1}], "progress": [], "events": None}),
    msgpack.packb({"finished": [], "progress": [["x", [1]]], "events": None}),
    msgpack.packb({"finished": [], "progress": [], "events": "text"}),
])
def test_bad_payloads_are_message_errors(payload):
    with pytest.raises(MessageError):
        decode_report(payload)
