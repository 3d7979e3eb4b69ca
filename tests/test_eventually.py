"""The tests' bounded wait: it returns what the condition returned, or fails saying what did
not happen; a fake clock keeps these tests instant."""
from __future__ import annotations

import pytest
from eventually import eventually


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_returns_the_first_true_value_without_waiting_more():
    clock, answers = FakeClock(), iter([0, [], "done", "late"])
    assert eventually(lambda: next(answers), 5, "x", clock=clock, sleep=clock.sleep) == "done"
    assert clock.now == pytest.approx(0.02)


def test_fails_at_the_deadline_saying_what_did_not_happen():
    clock, calls = FakeClock(), []

    def pool_size() -> int:
        calls.append(clock.now)
        return 0

    with pytest.raises(AssertionError, match=r"the pool drained: did not happen within 1 s "
                                             r"\(last: 0\)"):
        eventually(pool_size, 1, "the pool drained", interval_s=0.25, clock=clock,
                   sleep=clock.sleep)
    assert calls[0] == 0 and calls[-1] == pytest.approx(1.0)  # the last call at the deadline
    assert max(clock.sleeps) <= 0.25


def test_retried_exceptions_are_reported_and_others_raise():
    clock = FakeClock()

    def refused():
        raise ConnectionRefusedError("nobody listens")

    with pytest.raises(AssertionError, match="server up.*ConnectionRefusedError"):
        eventually(refused, 0.05, "server up", retry_on=(OSError,), clock=clock,
                   sleep=clock.sleep)
    with pytest.raises(ConnectionRefusedError):
        eventually(refused, 0.05, "server up", clock=clock, sleep=clock.sleep)


def test_an_asserting_condition_reports_its_last_words():
    clock, left = FakeClock(), iter([[3, 4], [4], [4]])

    def drained() -> bool:
        now = next(left, [4])
        assert not now, f"still used: {now}"
        return True

    with pytest.raises(AssertionError, match=r"the pool drained.*still used: \[4\]"):
        eventually(drained, 0.03, "the pool drained", retry_on=(AssertionError,), clock=clock,
                   sleep=clock.sleep)
