"""The storage worker: one thread that runs L3 prefetches (L3->L2) and backups (L2->L3).

Operations go in batches (the config's `storage_batch_pages`, 128 by default) with progress
published after each batch, so a waiting request can take the pages that already landed.
Prefetches go before backups and take turns batch by batch. A cancelled prefetch stops at the
next batch boundary; `settle` waits until the worker no longer touches its host pages, which
is what makes freeing them safe.
"""
from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import deque
from typing import Callable, Sequence

from kvtier.backends.base import KV_POOL, PagesStillInUse, StorageBackend, TransferResult
from kvtier.errors import ClosedError

log = logging.getLogger(__name__)


class OpState(enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (OpState.DONE, OpState.FAILED, OpState.CANCELLED)


class StorageOp:
    """A batch job over `keys` <-> `host_pages`; `done_pages` leading pages have succeeded.

    `missing_keys`: pages a prefetch's backend read answered as not there (absent, torn,
    corrupt). Unlike a cancelled, failed (raised) or hung op, that is the storage's own word
    that the page is gone, which the L3 directory wants to hear (StorageTier.finish)."""

    def __init__(self, op_id: int, keys: Sequence[str], host_pages: Sequence[int], payload: object,
                 on_change: Callable[["StorageOp"], None] | None = None):
        self.id = op_id
        self.keys = list(keys)
        self.host_pages = list(host_pages)
        self.payload = payload
        self.done_pages = 0
        self.missing_keys: list[str] = []
        self.next_page = 0
        self.state = OpState.QUEUED
        self.error: BaseException | None = None
        self.cancel_requested = False
        self.last_batch = False  # end after the batch being read (the first, if none started)
        self.submitted_s = time.monotonic()
        self.finished_s: float | None = None
        self.batch_started_s = 0.0  # when the worker took its current (or last) batch
        self.batch_pages = 0  # pages of that batch
        self._settled = threading.Event()
        self._on_change = on_change  # told when the op ends, and when a quarantined one settles

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    @property
    def settled(self) -> bool:
        return self._settled.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Block until the op ended (settled) or `timeout_s` passed; whether it ended."""
        return self._settled.wait(timeout_s)

    @property
    def quarantined(self) -> bool:
        """Ended, but the storage may still touch its host pages: they are never freed."""
        return self.state.finished and not self._settled.is_set()

    def _finish(self, state: OpState, settle: bool = True) -> None:
        self.state = state
        self.finished_s = time.monotonic()
        if settle:
            self._settled.set()
        self._notify()

    def _settle(self) -> None:
        """A quarantined op's call returned: its host pages are free to reuse."""
        self._settled.set()
        self._notify()

    def _notify(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change(self)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop the worker
                log.exception("a storage op listener failed")


class StorageWorker:
    """Runs storage ops on a thread; the backend is only ever called from that thread."""

    def __init__(self, backend: StorageBackend, batch_pages: int = 128, pool: str = KV_POOL,
                 on_change: Callable[[StorageOp], None] | None = None):
        """`on_change(op)`, when given, is called (on the worker's thread, or the thread that
        returns a quarantined call) when an op ends and again when a quarantined op settles:
        a caller that polls no op learns both."""
        self.backend = backend
        self._on_change = on_change
        self.batch_pages = batch_pages
        self.pool = pool
        self._ids = itertools.count(1)
        self._prefetches: deque[StorageOp] = deque()
        self._backups: deque[StorageOp] = deque()
        self._finished_backups: deque[StorageOp] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._running = 0  # ops the thread has taken off a queue and is stepping now
        self.read_s_per_page: float | None = None  # measured prefetch reads (None: none yet)
        self._thread = threading.Thread(target=self._run, name="kvtier-storage", daemon=True)
        self._thread.start()

    # ---- submission ----------------------------------------------------------------------
    def prefetch(self, keys: Sequence[str], host_pages: Sequence[int], payload: object = None) -> StorageOp:
        return self._submit(self._prefetches, keys, host_pages, payload)

    def backup(self, keys: Sequence[str], host_pages: Sequence[int], payload: object = None) -> StorageOp:
        return self._submit(self._backups, keys, host_pages, payload)

    def _submit(self, queue: deque, keys, host_pages, payload) -> StorageOp:
        with self._cv:
            if self._closed:
                raise ClosedError("the storage worker is closed; attach the backend again")
            op = StorageOp(next(self._ids), keys, host_pages, payload, self._on_change)
            queue.append(op)
            self._cv.notify()
        return op

    def cancel(self, op: StorageOp) -> None:
        """Stop `op` at its next batch boundary (pages already done stay done). An op waiting
        in a queue (never started, or between two batches) ends at once."""
        with self._cv:
            op.cancel_requested = True
            if op.state is OpState.QUEUED:
                self._cancel_queued(op)
            self._cv.notify()

    def stop_after_batch(self, op: StorageOp) -> None:
        """Let `op` end after the batch it is reading, or its first batch if none has started
        yet (it is submitted: only the worker's turn is pending); later batches never start.
        An op waiting between two batches ends at once."""
        with self._cv:
            op.last_batch = True
            if op.state is OpState.QUEUED and op.next_page > 0:
                self._cancel_queued(op)

    def _cancel_queued(self, op: StorageOp) -> None:
        """Take a QUEUED op out of its queue, CANCELLED (call under the lock)."""
        if op in self._prefetches:
            self._prefetches.remove(op)
        elif op in self._backups:
            self._backups.remove(op)
            self._finished_backups.append(op)
        op._finish(OpState.CANCELLED)

    def settle(self, op: StorageOp, timeout_s: float = 30.0) -> bool:
        """Wait until the worker is done with `op`'s host pages; False on timeout."""
        return op._settled.wait(timeout_s)

    def finished_backups(self) -> list[StorageOp]:
        """Backups that ended since the last call, in the order they ended, once the storage
        no longer touches their host pages: a quarantined backup is held back until it
        settles (never, if it cannot), so that its pages stay protected until then."""
        with self._cv:
            ended, self._finished_backups = self._finished_backups, deque()
            out = []
            for op in ended:  # `settled` read once per op: it may turn True meanwhile
                (out if op.settled else self._finished_backups).append(op)
        return out

    def pending(self) -> int:
        """Ops queued or being stepped (0: every backup that ended is in finished_backups,
        or held back there while quarantined)."""
        with self._cv:
            return len(self._prefetches) + len(self._backups) + self._running

    # ---- the thread ----------------------------------------------------------------------
    def _next(self) -> tuple[StorageOp, bool] | None:
        """The next op to step, RUNNING from the moment it leaves its queue (under the lock,
        so a cancel either finds it queued and ends it, or finds it running and waits)."""
        with self._cv:
            while not self._closed and not self._prefetches and not self._backups:
                self._cv.wait()
            queue = self._prefetches or self._backups
            if not queue:
                return None  # closed and drained
            op = queue.popleft()
            # the batch first: a reader that sees RUNNING (no lock) sees this batch's stamp
            op.batch_started_s = time.monotonic()
            op.batch_pages = min(op.next_page + self.batch_pages, op.num_pages) - op.next_page
            op.state = OpState.RUNNING
            self._running += 1
            return op, queue is self._prefetches

    def _run(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            op, is_prefetch = item
            self._step(op, is_prefetch)
            with self._cv:
                self._running -= 1
                if not op.state.finished:  # more batches: take turns with the others
                    op.state = OpState.QUEUED
                    (self._prefetches if is_prefetch else self._backups).append(op)
                    if op.cancel_requested or op.last_batch:
                        self._cancel_queued(op)
                elif not is_prefetch:
                    self._finished_backups.append(op)

    def _step(self, op: StorageOp, is_prefetch: bool) -> None:
        start, stop = op.next_page, min(op.next_page + self.batch_pages, op.num_pages)
        keys, pages = op.keys[start:stop], op.host_pages[start:stop]
        try:
            started = time.monotonic()
            result = self._move(op, start, pages, is_prefetch)
        except PagesStillInUse as exc:  # the storage may still write into these pages
            log.error("storage %s of %d pages gave up while the storage may still use its "
                      "host pages (%s); they are quarantined, %s",
                      "prefetch" if is_prefetch else "backup", len(keys), exc,
                      "never reused" if exc.pending is None else "until its call returns")
            op.error = exc
            op._finish(OpState.FAILED, settle=False)
            if exc.pending is not None:  # the backend says when the storage lets go of them
                exc.pending.add_done_callback(lambda _call: op._settle())
            return
        except Exception as exc:  # a backend failure is a miss for this op, never a crash
            log.warning("storage %s of %d pages failed: %s", "prefetch" if is_prefetch else "backup",
                        len(keys), exc)
            op.error = exc
            op._finish(OpState.FAILED)
            return
        good = result.leading_ok
        if is_prefetch:
            op.missing_keys += [k for k, ok in zip(keys, result.ok) if not ok]
            if good:
                self._note_read((time.monotonic() - started) / good)
        op.done_pages += good
        op.next_page = stop
        if good < len(keys) or stop == op.num_pages:
            op._finish(OpState.DONE)  # a miss ends a prefix: later pages are unusable

    def _move(self, op: StorageOp, start: int, pages: list[int],
              is_prefetch: bool) -> TransferResult:
        """One batch of `op` (its pages from `start`): read into or written from `pages`."""
        move = self.backend.get_into if is_prefetch else self.backend.set_from
        return move(self.pool, op.keys[start : start + len(pages)], pages)

    def _note_read(self, s_per_page: float) -> None:
        """Fold one read's seconds per page into the running estimate (recent reads weigh
        most: the machine's load and the storage's speed change)."""
        old = self.read_s_per_page
        self.read_s_per_page = s_per_page if old is None else 0.7 * old + 0.3 * s_per_page

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel queued work, let the running batch finish, stop the thread."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            for queue in (self._prefetches, self._backups):
                for op in queue:
                    op.cancel_requested = True
                    op._finish(OpState.CANCELLED)
                    if queue is self._backups:
                        self._finished_backups.append(op)
                queue.clear()
            self._cv.notify_all()
        self._thread.join(timeout_s)
