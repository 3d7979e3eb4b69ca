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
    failed = dataclasses.replace(OUT, finish_reason=FinishReason.ERROR, error="it failed")
    report = StepReport([OUT, with_logprobs, failed],
                        {3: Progress(0, (9, 8)), 4: Progress(5, (4,), logprobs[:1])},
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
    msgpack.packb({"finished": [], "progress": [[1, "x", [1], None]], "events": None,
                   "handoffs": []}),
    msgpack.packb({"finished": [], "progress": [], "events": "text"}),
])
def test_bad_payloads_are_message_errors(payload):
    with pytest.raises(MessageError):
        decode_report(payload)


def test_progress_after_what_a_caller_has():
    lps = (TokenLogprob(4, -0.5, ()), TokenLogprob(5, -1.0, ()), TokenLogprob(6, -2.0, ()))
    p = Progress(3, (4, 5, 6), lps)
    assert p.stop == 6
    assert p.after(3) == p and p.after(0) == p
    assert p.after(4) == Progress(4, (5, 6), lps[1:])
    assert p.after(6) is None and p.after(9) is None
    assert Progress(0, (1, 2)).after(1) == Progress(1, (2,), None)


def test_resume_round_trips():
    from kvtier.actors.step_wire import resume_from_wire, resume_to_wire
    from kvtier.engine.request import Resume

    r = Resume((4, 5), (TokenLogprob(4, -0.5, ((4, -0.5),)), TokenLogprob(5, -0.1, ())))
    assert resume_from_wire(resume_to_wire(r)) == r
    assert resume_from_wire(resume_to_wire(Resume((1,)))) == Resume((1,))
    assert resume_to_wire(None) is None and resume_from_wire(None) is None
    with pytest.raises(MessageError):
        resume_from_wire([["x"], None])


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
            rank.add_request([1 + i, 2, 3, 4, 5], params)
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
