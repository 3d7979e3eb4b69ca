"""Client calls with a deadline (backends/bounded_calls.py), with calls that block on events."""
from __future__ import annotations

import threading

import pytest

from kvtier.backends.bounded_calls import BoundedCalls, CallState


def _blocked(release: threading.Event, value=None):
    """A call that returns `value` once `release` is set (bounded: 60 s at most)."""
    def call():
        assert release.wait(60), "the test never released the call"
        return value
    return call


def test_a_call_within_the_deadline_returns_its_value_or_its_error():
    calls = BoundedCalls(timeout_s=5)
    assert calls.run(lambda a, b: a + b, 2, 3) == (CallState.DONE, 5, None, None)

    def boom():
        raise KeyError("engine said no")
    out = calls.run(boom)
    assert out.state is CallState.DONE and isinstance(out.error, KeyError)

    def own_timeout():  # a TimeoutError of the call itself is its error, not the deadline
        raise TimeoutError("the client's own")
    out = calls.run(own_timeout)
    assert out.state is CallState.DONE and isinstance(out.error, TimeoutError)
    assert calls.timed_out == 0 and calls.stuck == 0


def test_a_call_past_the_deadline_is_left_running_and_says_when_it_returns():
    calls = BoundedCalls(timeout_s=0.05)
    release = threading.Event()
    out = calls.run(_blocked(release, "late"))
    assert out.state is CallState.TIMED_OUT and not out.pending.done()
    assert calls.stuck == 1 and calls.timed_out == 1
    release.set()
    assert out.pending.result(timeout=30) == "late"
    assert calls.stuck == 0
    assert calls.run(lambda: 7).value == 7  # the thread is reused


def test_stuck_calls_are_bounded_and_later_calls_refused_until_one_returns():
    """Never more than max_stuck calls past their deadline, and never more threads: a call
    made while that many are stuck is not started at all."""
    calls = BoundedCalls(timeout_s=0.05, max_stuck=2)
    releases = [threading.Event() for _ in range(2)]
    started = threading.active_count()
    outs = [calls.run(_blocked(r)) for r in releases]
    assert [o.state for o in outs] == [CallState.TIMED_OUT] * 2 and calls.stuck == 2
    ran = []
    refused = calls.run(lambda: ran.append(1))
    assert refused.state is CallState.REFUSED and ran == [] and calls.refused == 1
    assert threading.active_count() - started <= 2
    releases[0].set()
    outs[0].pending.result(timeout=30)
    assert calls.run(lambda: "again").value == "again"
    assert threading.active_count() - started <= 2
    releases[1].set()
    outs[1].pending.result(timeout=30)
    assert calls.stuck == 0


def test_close_waits_for_stuck_calls_before_running_on_idle():
    """The client must not be closed under a call still using it: close() runs `on_idle` when
    the last stuck call returns, on that call's thread, and refuses new calls meanwhile."""
    calls = BoundedCalls(timeout_s=0.05)
    release, closed = threading.Event(), threading.Event()
    out = calls.run(_blocked(release))
    assert calls.close(closed.set) is False and not closed.is_set()
    assert calls.run(lambda: 1).state is CallState.REFUSED
    release.set()
    out.pending.result(timeout=30)
    assert closed.wait(30)

    idle, ran = BoundedCalls(timeout_s=1), []
    assert idle.run(lambda: 1).value == 1
    assert idle.close(lambda: ran.append(1)) is True and ran == [1]


@pytest.mark.parametrize("timeout_s, max_stuck", [(0, 2), (-1, 2), (1, 0)])
def test_nonsense_limits_are_refused(timeout_s, max_stuck):
    with pytest.raises(ValueError):
        BoundedCalls(timeout_s, max_stuck)
