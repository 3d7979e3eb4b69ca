"""Blocking client calls with a deadline: each runs on a helper thread and is awaited at most
`timeout_s`.

Why: a storage client call can block far longer than any caller may wait, and the client
cannot be told to stop. Measured with Mooncake 0.3.13 (tcp), against a segment whose host's
link is cut: a read on an open connection waits for Mooncake's TCP progress timeout (30 s by
default); a read that must open the connection first tries the handshake once per object, each
for MC_HANDSHAKE_CONNECT_TIMEOUT (5 s by default), so a batch of 768 objects would wait over
an hour. So the caller waits `timeout_s`, and a call still running then is left to finish on
its thread: it is "stuck", and its Future (`CallOutcome.pending`) says when it returns, which
is when the memory it was given may be reused (`PagesStillInUse.pending`, tiers/storage_worker.py).

Bounded: a call starts only while fewer than `max_stuck` calls are stuck; once that many
are, further calls are refused at once (no thread, no wait; the backend answers a miss).
With C callers at once (a Mooncake batch's lanes, an existence check beside them), at most
`max_stuck - 1 + C` calls can be stuck together, so a dead peer costs that many threads and
the pages they hold, never an unbounded number. Threads are reused (at most `max_stuck + 1`
wait idle) and are daemons: a stuck call never holds up the interpreter's exit. The client
must be thread-safe (Mooncake's is, and it releases the GIL while it waits).
"""
from __future__ import annotations

import enum
import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple

log = logging.getLogger(__name__)

MAX_STUCK_CALLS = 2


class CallState(enum.Enum):
    DONE = "done"  # returned (or raised: `error`) within the deadline
    TIMED_OUT = "timed_out"  # still running: `pending` is done when it returns
    REFUSED = "refused"  # never started: too many calls are stuck, or closed


class CallOutcome(NamedTuple):
    state: CallState
    value: Any = None
    error: BaseException | None = None
    pending: Future | None = None


_REFUSED = CallOutcome(CallState.REFUSED)


class _Worker:
    """One helper thread with its own job queue; it offers itself back after each job."""

    def __init__(self, owner: "BoundedCalls", index: int) -> None:
        self.owner = owner
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, daemon=True,
                                       name=f"{owner.name}-{index}")
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            fn, args, future = job
            value, error = None, None
            try:
                value = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, never lost
                error = exc
            keep = self.owner._returned(self)  # idle again before the caller wakes up
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)
            if not keep:
                return


class BoundedCalls:
    """Runs `fn(*args)` on a helper thread; the caller waits at most `timeout_s`."""

    def __init__(self, timeout_s: float, max_stuck: int = MAX_STUCK_CALLS,
                 name: str = "kvtier-call") -> None:
        if timeout_s <= 0 or max_stuck < 1:
            raise ValueError("timeout_s must be > 0 and max_stuck >= 1")
        self.timeout_s, self.max_stuck, self.name = timeout_s, max_stuck, name
        self._lock = threading.Lock()
        self._idle: list[_Worker] = []
        self._stuck: set[Future] = set()
        self._started = 0  # threads ever started (names)
        self._closed = False
        self._on_idle: Callable[[], None] | None = None
        self.timed_out = self.refused = 0  # counters

    @property
    def stuck(self) -> int:
        """Calls that passed their deadline and have not returned yet."""
        with self._lock:
            return len(self._stuck)

    def run(self, fn: Callable[..., Any], *args: Any) -> CallOutcome:
        with self._lock:
            if self._closed or len(self._stuck) >= self.max_stuck:
                self.refused += 1
                return _REFUSED
            worker = self._idle.pop() if self._idle else self._new_worker()
        future: Future = Future()
        future.set_running_or_notify_cancel()
        worker.jobs.put((fn, args, future))
        try:
            return CallOutcome(CallState.DONE, value=future.result(self.timeout_s))
        except TimeoutError:
            if not future.done():
                return self._left_running(future)
        except BaseException as exc:  # noqa: BLE001 - the call's own error
            return CallOutcome(CallState.DONE, error=exc)
        # done just after the wait ended, or the call itself raised TimeoutError
        error = future.exception()
        return CallOutcome(CallState.DONE, value=None if error else future.result(), error=error)

    def _new_worker(self) -> _Worker:
        self._started += 1
        return _Worker(self, self._started)

    def _left_running(self, future: Future) -> CallOutcome:
        with self._lock:
            self._stuck.add(future)
            self.timed_out += 1
        future.add_done_callback(self._unstuck)  # at once if it returned meanwhile
        return CallOutcome(CallState.TIMED_OUT, pending=future)

    def _unstuck(self, future: Future) -> None:
        with self._lock:
            self._stuck.discard(future)
            on_idle = self._on_idle if self._closed and not self._stuck else None
            if on_idle is not None:
                self._on_idle = None
        if on_idle is not None:
            on_idle()

    def _returned(self, worker: _Worker) -> bool:
        """A worker finished its job: True if it waits for the next one (it is idle)."""
        with self._lock:
            if self._closed or len(self._idle) > self.max_stuck:
                return False
            self._idle.append(worker)
            return True

    def close(self, on_idle: Callable[[], None]) -> bool:
        """Refuse further calls and end idle threads; run `on_idle` (such as closing the
        client) now when no call is stuck, else on the thread of the last stuck call to
        return. True when it ran now."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            run_now = not self._stuck
            if not run_now:
                self._on_idle = on_idle
        for worker in idle:
            worker.jobs.put(None)
        if run_now:
            on_idle()
        else:
            log.warning("%s: %d call(s) still running past their deadline; the client is "
                        "closed when they return", self.name, len(self._stuck))
        return run_now
