"""StorageWorker.pending() counts the op the thread is stepping: a drain that waits for
pending() == 0 then sees every ended backup in finished_backups (cross-instance L3 hits rely
on it: A's quiesce must report its stored pages before B looks them up)."""
from __future__ import annotations

import threading
import time

from kvtier.backends.base import TransferResult
from kvtier.tiers.storage_worker import StorageWorker


class SlowBackend:
    """set_from blocks until released: the op stays mid-step."""

    def __init__(self) -> None:
        self.entered, self.release = threading.Event(), threading.Event()

    def set_from(self, pool, keys, pages) -> TransferResult:
        self.entered.set()
        assert self.release.wait(10)
        return TransferResult([True] * len(keys), 0)


def test_pending_counts_the_running_op_until_it_is_in_finished_backups() -> None:
    backend = SlowBackend()
    worker = StorageWorker(backend)  # type: ignore[arg-type]
    try:
        op = worker.backup(["k1", "k2"], [0, 1])
        assert backend.entered.wait(10)  # the thread took it off the queue and is in set_from
        assert worker.pending() == 1
        assert worker.finished_backups() == []
        backend.release.set()
        deadline = time.monotonic() + 10
        while worker.pending() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert worker.pending() == 0
        assert worker.finished_backups() == [op] and op.done_pages == 2
    finally:
        backend.release.set()
        worker.close()
