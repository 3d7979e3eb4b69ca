"""Jobs run in order on one thread of their own: a worker's background traffic (its L3 writes
and reads, its reads from peers), so that no step waits for storage or a peer."""
from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, TypeVar

Job = TypeVar("Job")


class JobThread(Generic[Job]):
    """Runs `run(job)` for each job put, in order, on one daemon thread named `name`."""

    def __init__(self, name: str, run: Callable[[Job], None]) -> None:
        self._run = run
        self._jobs: queue.Queue[Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, job: Job) -> None:
        self._jobs.put(job)

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued jobs, then stop (waiting `timeout_s` at most)."""
        self._jobs.put(None)
        self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._run(job)
