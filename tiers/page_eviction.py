"""Deleting L3 pages off the directory's lock: the delete queue, one pass, the pass thread.

Why: a delete can be slow (a remote store, thousands of unlinks, a hung mount), and the
namespace service holds one lock around every directory call, so a delete made inside a
call would stall every lookup and report of every namespace behind it. Instead the page
directory only decides: it unpublishes its victims first (nobody is told to read a page
being deleted) and queues their deletes here; a pass takes queued deletes under the lock
(quick), calls `store.delete` outside it, and hands the outcomes back under it.

A page stays "doomed" from the moment it is queued until its delete has run: the directory
ignores reports of it meanwhile, so it is never published pointing at objects about to go.

`run_pass` is one pass, synchronous (tests and in-process users call it directly);
`EvictionThread` runs passes in the background for the namespace service: woken when the
directory says a pass is due, and every `interval_s` anyway, since leases and unfinished
pages lapse with time, not with calls. Plain Python, no Ray.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections import OrderedDict
from typing import Callable, ContextManager, NamedTuple, Protocol, Sequence

from kvtier.tiers.page_store import PageStore

log = logging.getLogger(__name__)

DELETE_BATCH_PAGES = 256  # pages per store.delete call
MAX_ROUNDS_PER_PASS = 64  # bounds one pass; what is left makes the next pass due at once
PASS_INTERVAL_S = 1.0


class DeleteBatch(NamedTuple):
    """Pages of one namespace to delete through its store, outside the directory's lock."""

    batch_id: int
    namespace: str
    hashes: tuple[str, ...]
    store: PageStore


class DeleteOutcome(NamedTuple):
    batch_id: int
    removed: int  # what the store reports removed ((page, rank) object sets)
    error: str = ""  # "" = the delete ran; else why it failed (the objects may stay)


class PassResult(NamedTuple):
    queued: int  # pages the pass's eviction step queued for deletion
    deleted: int  # pages whose delete ran
    failed: int  # pages whose delete failed


class EvictingDirectory(Protocol):
    """What a pass needs from the directory (kvtier.tiers.page_directory.PageDirectory)."""

    def eviction_pass(self) -> int: ...

    def take_deletes(self, max_pages: int = DELETE_BATCH_PAGES) -> list[DeleteBatch]: ...

    def deletes_done(self, outcomes: Sequence[DeleteOutcome]) -> None: ...

    @property
    def pass_due(self) -> bool: ...


class DeleteQueue:
    """Pages queued for deletion per namespace, the batches out for deletion, and the stores
    that must stay open until those return.

    Owned by the directory and, like it, single-threaded under its owner's lock."""

    def __init__(self) -> None:
        self._queued: dict[str, OrderedDict[str, None]] = {}
        self._doomed: dict[str, set[str]] = {}  # queued or in flight, per namespace
        self._in_flight: dict[int, DeleteBatch] = {}
        self._retired: list[PageStore] = []  # replaced stores a delete in flight still uses
        self._ids = itertools.count(1)
        self.added = 0  # pages ever queued (a pass reports how many it queued)

    def add(self, ns: str, hashes: Sequence[str]) -> int:
        """Queue deletes of `hashes` (those not doomed already); how many were new."""
        doomed = self._doomed.setdefault(ns, set())
        queue = self._queued.setdefault(ns, OrderedDict())
        new = [h for h in dict.fromkeys(hashes) if h not in doomed]
        doomed.update(new)
        queue.update(dict.fromkeys(new))
        self.added += len(new)
        return len(new)

    def doomed(self, ns: str, page_hash: str) -> bool:
        return page_hash in self._doomed.get(ns, ())

    def count(self, ns: str) -> int:
        """Pages of `ns` queued or being deleted."""
        return len(self._doomed.get(ns, ()))

    @property
    def queued(self) -> bool:
        return any(self._queued.values())

    def take(self, max_pages: int, store_of: Callable[[str], PageStore]) -> list[DeleteBatch]:
        """Up to `max_pages` queued pages of each namespace, as batches now in flight."""
        batches = []
        for ns, queue in self._queued.items():
            if not queue:
                continue
            hashes = tuple(itertools.islice(queue, max(1, max_pages)))
            for h in hashes:
                del queue[h]
            batch = DeleteBatch(next(self._ids), ns, hashes, store_of(ns))
            self._in_flight[batch.batch_id] = batch
            batches.append(batch)
        return batches

    def done(self, batch_id: int) -> DeleteBatch | None:
        """The batch's delete ran (or failed): its pages may be reported again."""
        batch = self._in_flight.pop(batch_id, None)
        if batch is not None:
            self._doomed.get(batch.namespace, set()).difference_update(batch.hashes)
            self.retire()
        return batch

    def retire(self, store: PageStore | None = None) -> None:
        """Close `store` (replaced, or the directory closes) now, or once no delete runs on
        it: closing a client under a running delete could crash it. Then close any other
        retired store that became free."""
        if store is not None:
            self._retired.append(store)
        busy = {id(b.store) for b in self._in_flight.values()}
        for s in [s for s in self._retired if id(s) not in busy]:
            s.close()
        self._retired = [s for s in self._retired if id(s) in busy]

    def drop_queued(self, ns: str) -> int:
        """Forget the deletes of `ns` not taken yet (its storage was replaced); how many."""
        queue = self._queued.pop(ns, OrderedDict())
        self._doomed.get(ns, set()).difference_update(queue)
        return len(queue)

    def clear(self) -> None:
        """Forget everything (the directory closes); a store a delete still runs on is left
        unclosed, to the process's exit."""
        if self._retired:
            log.warning("%d L3 stores still have a delete running; their clients are left "
                        "open", len(self._retired))
        self._queued.clear()
        self._doomed.clear()
        self._in_flight.clear()
        self._retired.clear()


def delete_batch(batch: DeleteBatch) -> DeleteOutcome:
    """Run one batch's delete; never raises (an unanswered batch would stay doomed)."""
    try:
        return DeleteOutcome(batch.batch_id, int(batch.store.delete(list(batch.hashes))))
    except Exception as exc:  # noqa: BLE001 - counted by the directory, retried at a rebuild
        return DeleteOutcome(batch.batch_id, 0, f"{type(exc).__name__}: {exc}")


def run_pass(directory: EvictingDirectory, lock: ContextManager | None = None,
             batch_pages: int = DELETE_BATCH_PAGES,
             stop: threading.Event | None = None) -> PassResult:
    """One pass: evict what the quota and the clocks ask for, then run every queued delete
    (at most MAX_ROUNDS_PER_PASS rounds), each `store.delete` outside `lock`."""
    lock = lock if lock is not None else contextlib.nullcontext()
    with lock:
        queued = directory.eviction_pass()
    deleted = failed = 0
    for _ in range(MAX_ROUNDS_PER_PASS):
        if stop is not None and stop.is_set():
            break
        with lock:
            batches = directory.take_deletes(batch_pages)
        if not batches:
            break
        outcomes = [delete_batch(b) for b in batches]  # the slow part: no lock held
        with lock:
            directory.deletes_done(outcomes)
        for batch, outcome in zip(batches, outcomes):
            if outcome.error:
                failed += len(batch.hashes)
            else:
                deleted += len(batch.hashes)
    return PassResult(queued, deleted, failed)


class EvictionThread:
    """Runs `run_pass` on a background thread (started at the first `wake`); `close` stops
    it, waiting at most `join_timeout_s` for a pass stuck in a delete. `run_now` runs one in
    the caller's thread; passes never overlap (a store's client serves one thread at a time),
    and no directory call ever waits for one."""

    def __init__(self, directory: EvictingDirectory, lock: ContextManager,
                 interval_s: float = PASS_INTERVAL_S, batch_pages: int = DELETE_BATCH_PAGES,
                 join_timeout_s: float = 10.0) -> None:
        self.directory, self.lock = directory, lock
        self.interval_s, self.batch_pages = interval_s, batch_pages
        self.join_timeout_s = join_timeout_s
        self._wake, self._stop = threading.Event(), threading.Event()
        self._passes = threading.Condition()
        self._one_pass = threading.Lock()  # held for a whole pass, never by directory calls
        self._started = self._finished = 0  # passes, for wait_next_pass
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """Ask for a pass soon (cheap: callers hold the directory's lock)."""
        with self._passes:  # callers may race (wait_next_pass holds no directory lock)
            if self._stop.is_set():
                return
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="kvtier-l3-evictor")
                self._thread.start()
        self._wake.set()

    def run_now(self) -> PassResult:
        """One pass in the calling thread (after any pass already running)."""
        with self._one_pass:
            return run_pass(self.directory, self.lock, self.batch_pages)

    def wait_next_pass(self, timeout_s: float) -> bool:
        """Wait until a pass that starts after this call has finished; False on timeout."""
        with self._passes:
            target = self._started + 1
        self.wake()
        with self._passes:
            return self._passes.wait_for(lambda: self._finished >= target, timeout_s)

    def _loop(self) -> None:
        while not self._stop.is_set():  # bounded: close() sets the event
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._stop.is_set():
                break
            with self._passes:
                self._started += 1
            try:
                with self._one_pass:
                    run_pass(self.directory, self.lock, self.batch_pages, self._stop)
                with self.lock:
                    if self.directory.pass_due:  # the pass hit its bound: go again at once
                        self._wake.set()
            except Exception:  # noqa: BLE001 - the loop must outlive one bad pass
                log.exception("L3 eviction pass failed")
            finally:
                with self._passes:
                    self._finished += 1
                    self._passes.notify_all()

    def close(self) -> None:
        with self._passes:
            self._stop.set()
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(self.join_timeout_s)
            if thread.is_alive():
                log.warning("the L3 eviction thread is still inside a delete after %.0f s; "
                            "leaving it behind (a hung storage?)", self.join_timeout_s)
