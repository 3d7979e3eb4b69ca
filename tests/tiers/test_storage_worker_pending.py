"""StorageWorker's bookkeeping: pending() counts the op the thread is stepping (a drain that
waits for pending() == 0 then sees every ended backup in finished_backups: cross-instance L3
hits rely on it); an op waiting between batches is cancelled at once; a transfer that gave up
while the storage may still use its pages never settles (they stay quarantined)."""
from __future__ import annotations

import threading
from concurrent.futures import Future

from eventually import eventually

from kvtier.backends.base import PagesStillInUse, TransferResult
from kvtier.tiers.storage_worker import OpState, StorageWorker

KEY = "ab" * 32


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
        eventually(lambda: worker.pending() == 0, 10, "the op ended", interval_s=0.001)
        assert worker.finished_backups() == [op] and op.done_pages == 2
    finally:
        backend.release.set()
        worker.close()


class _GatedBackend:
    """A backend stand-in: the first `get_into` returns at once, the second blocks until
    `release` is set; `gave_up` makes a call raise PagesStillInUse instead."""

    def __init__(self) -> None:
        self.calls = 0
        self.entered, self.release = threading.Event(), threading.Event()
        self.gave_up = False

    def get_into(self, pool, keys, pages):
        self.calls += 1
        if self.gave_up:
            raise PagesStillInUse("injected: a transfer timed out and could not be cancelled")
        if self.calls == 2:
            self.entered.set()
            assert self.release.wait(30)
        return TransferResult([True] * len(keys), 0)

    set_from = get_into


def test_an_op_between_two_batches_is_cancelled_at_once():
    """A prefetch re-queued after its first batch is QUEUED again: cancelling it takes it out
    of the queue and settles it at once, even while the worker is stuck in another op's call
    (before, it stayed RUNNING in the queue and its request waited)."""
    backend = _GatedBackend()
    worker = StorageWorker(backend, batch_pages=1)
    try:
        first = worker.prefetch([KEY] * 2, [0, 1])  # two batches
        second = worker.prefetch([KEY], [2])  # its call blocks
        assert backend.entered.wait(30)  # the worker: first's batch 1, then second (stuck)
        assert first.state is OpState.QUEUED and first.done_pages == 1
        worker.cancel(first)
        assert worker.settle(first, timeout_s=5.0), "cancel left a queued op unsettled"
        assert first.state is OpState.CANCELLED and first.done_pages == 1
    finally:
        backend.release.set()
        worker.close()
    assert second.state is OpState.DONE


def test_a_transfer_that_gave_up_keeps_its_pages_quarantined():
    """PagesStillInUse (a NIXL timeout): the op fails but never settles, so its host pages
    are never freed or reused while the storage may still write into them."""
    backend = _GatedBackend()
    backend.gave_up = True
    worker = StorageWorker(backend, batch_pages=4)
    try:
        op = worker.prefetch([KEY], [3])
        eventually(lambda: op.state.finished, 30, "the transfer ended")
        assert op.state is OpState.FAILED and op.quarantined
        assert not worker.settle(op, timeout_s=0.1)
    finally:
        worker.close()


class _GaveUpBackend:
    """Every call gives up while its storage call runs on: PagesStillInUse with `call`, a
    Future the test completes when "the storage" lets go of the pages (None: it never says)."""

    def __init__(self, call: Future | None) -> None:
        self.call = call

    def get_into(self, pool, keys, pages):
        raise PagesStillInUse("injected: the call is past its deadline", pending=self.call)

    set_from = get_into


def _ended(op) -> None:
    eventually(lambda: op.state.finished, 30, "the transfer ended")
    assert op.state is OpState.FAILED


def test_a_transfer_that_gave_up_settles_once_its_call_returns():
    """PagesStillInUse with the call's Future (a Mooncake call past its deadline): the op
    fails at once and stays quarantined only until the call returns."""
    call: Future = Future()
    worker = StorageWorker(_GaveUpBackend(call), batch_pages=4)
    try:
        op = worker.prefetch([KEY], [3])
        _ended(op)
        assert op.quarantined and not worker.settle(op, timeout_s=0.1)
        call.set_result([-800])
        assert worker.settle(op, timeout_s=5.0) and not op.quarantined
    finally:
        worker.close()


def test_a_quarantined_backup_is_handed_back_only_once_it_settles():
    """Its caller releases the backup's L2 pages when finished_backups hands it back, so a
    backup whose call may still read them is held back: until the call returns, or for good
    when the backend cannot tell."""
    call: Future = Future()
    worker, never = StorageWorker(_GaveUpBackend(call)), StorageWorker(_GaveUpBackend(None))
    try:
        op, stuck = worker.backup([KEY], [0]), never.backup([KEY], [0])
        _ended(op)
        _ended(stuck)
        assert worker.pending() == 0 and worker.finished_backups() == []
        call.set_result([0])
        assert worker.finished_backups() == [op] and worker.finished_backups() == []
        assert never.finished_backups() == [] and stuck.quarantined
    finally:
        worker.close()
        never.close()
