"""A request's state changes only through Request's transitions, each legal from given states."""
from __future__ import annotations

import pytest

from kvtier.engine.request import FinishReason, Request, RequestState
from kvtier.engine.sampling import SamplingParams


def _req() -> Request:
    return Request(1, (1, 2, 3), SamplingParams(max_new_tokens=4))


def test_the_life_of_a_request_goes_through_its_transitions():
    req = _req()
    assert req.state is RequestState.WAITING
    req.start_prefill(None, [7], 0, 0)  # type: ignore[arg-type]
    assert (req.state, req.pages, req.pos) == (RequestState.PREFILLING, [7], 0)
    req.start_decoding()
    req.retract()
    assert (req.state, req.pages) == (RequestState.RETRACTED, [])
    req.resume(None, [8])  # type: ignore[arg-type]
    req.fold()  # preempted
    assert req.state is RequestState.WAITING and req.pages == []
    req.adopt(None, [9])  # type: ignore[arg-type]
    assert (req.state, req.pos) == (RequestState.DECODING, 3)
    req.finish(FinishReason.LENGTH)
    assert req.state is RequestState.FINISHED and req.finish_s is not None


@pytest.mark.parametrize("illegal", [
    lambda r: r.start_decoding(),  # nothing prefilled
    lambda r: r.retract(),  # not decoding
    lambda r: r.resume(None, []),  # never retracted
    lambda r: r.fold(),  # holds nothing to give back
    lambda r: r.restart(),
])
def test_an_illegal_transition_is_refused(illegal):
    req = _req()
    with pytest.raises(AssertionError, match="WAITING -> .* is not a legal transition"):
        illegal(req)
    assert req.state is RequestState.WAITING


def test_a_finished_request_stays_finished():
    req = _req()
    req.finish(FinishReason.ABORTED)
    for illegal in (lambda: req.finish(FinishReason.STOP), lambda: req.start_prefill(
            None, [], 0, 0), lambda: req.adopt(None, [])):  # type: ignore[arg-type]
        with pytest.raises(AssertionError, match="FINISHED -> "):
            illegal()
    with pytest.raises(AttributeError):
        req.state = RequestState.WAITING  # type: ignore[misc]
