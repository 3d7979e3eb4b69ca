"""`eventually`: the one bounded wait the tests use, instead of sleeps and ad-hoc loops.

A test that waits for something another thread or process does (a prefetch to land, an actor
to come back, processes to exit) polls a condition until it holds or a timeout passes, and
fails with a message that says what did not happen. A sleep of a production constant plus a
margin is both slow (it always waits the worst case) and flaky (a busy machine overruns the
margin); a poll ends as soon as the condition holds.

    from eventually import eventually   # tests/ is on sys.path (tests/conftest.py's folder)

    eventually(lambda: ticket.op.state.finished, 30, "the prefetch finished")
    pid = eventually(lambda: find_pid(), 10, "the server started", retry_on=(OSError,))

A condition may do work each round (step an instance, send a request): it is called until it
returns something true, and that value is returned. To have the failure say what the state
was, let the condition assert it and retry on AssertionError (the last one is reported):

    def drained():
        assert not (left := pool.used_pages()), f"still used: {left}"
        return True
    eventually(drained, 10, "the pool drained", retry_on=(AssertionError,))
"""
from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def eventually(condition: Callable[[], T], timeout_s: float, what: str, *,
               interval_s: float = 0.01, retry_on: tuple[type[BaseException], ...] = (),
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> T:
    """Call `condition` every `interval_s` until it returns a true value (returned) or
    `timeout_s` has passed (AssertionError: `what` did not happen, with the last value or
    the last exception of a `retry_on` type). It is called at least once, the last time at
    the deadline."""
    deadline = clock() + timeout_s
    while True:
        try:
            last: object = condition()
        except retry_on as exc:
            last = exc
        else:
            if last:
                return last  # type: ignore[return-value]
        now = clock()
        if now >= deadline:
            raise AssertionError(f"{what}: did not happen within {timeout_s:g} s "
                                 f"(last: {last!r})")
        sleep(min(interval_s, deadline - now))
