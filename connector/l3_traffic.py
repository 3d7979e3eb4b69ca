"""One worker's L3 traffic: its KV heads of pages written to and read from the namespace's
storage by the cache's own storage worker (kvtier.tiers.storage_worker), on a thread of its
own so that no step waits for storage (docs/vllm.md).

The scheduler side never reuses a slot while a rank still reads it for a write, nor loads a
slot before every rank read it in, nor hands out a slot a rank's read may still write
(kvtier.connector.l2_index), so the thread works on the host pool without locks. A storage
call that gave up while the storage may still touch its pages (`PagesStillInUse`: a
transfer that timed out and could not be cancelled) quarantines them, as it does under
kvtier's own engine: a write's slot stays unevictable until the call returns (its vote comes
then), a read's slots are reported held until then. Each finished slot is handed back once,
through `take`, for the step's report. The objects are kvtier's (one per page, KV head and
part), named by the backend from the page key and the head's global index, so a page written
at one TP size is read at another.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

import torch

from kvtier.backends.base import KV_POOL, StorageBackend
from kvtier.connector.plan import Ticket
from kvtier.tiers.storage_worker import StorageOp, StorageWorker

log = logging.getLogger(__name__)


class HostPoolView:
    """A worker's host pool `[slots, heads, 2, layers, values]` as a backend's PagedPool."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        self.num_pages = host.shape[0]

    def page_head_view(self, page: int, head: int, part: int) -> torch.Tensor:
        """K (part 0) or V (part 1) of this rank's head `head` of slot `page`, over the
        layers: one contiguous run of bytes."""
        return self.host[page, head, part].reshape(-1).view(torch.uint8)

    def data_ptr(self) -> int:
        return self.host.data_ptr()

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


@dataclass
class TrafficResults:
    stored: list[int] = field(default_factory=list)  # slots written (or given up on)
    failed_stores: set[int] = field(default_factory=set)  # of those: given up on
    fetched: list[Ticket] = field(default_factory=list)  # read in
    failed_fetches: list[Ticket] = field(default_factory=list)  # not read; nothing writes them
    held_fetches: list[Ticket] = field(default_factory=list)  # not read; a call may still
    released: list[Ticket] = field(default_factory=list)  # of held ones: the call returned


class _Fetch(NamedTuple):
    """A read's payload on the storage worker: the generation of the fetch it serves."""

    gen: int


class L3Traffic:
    """Writes and reads of one rank's objects through a storage worker: reads before writes,
    each in order."""

    def __init__(self, backend: StorageBackend, host: torch.Tensor,
                 report_stored: Callable[[Sequence[str]], None]) -> None:
        self.backend = backend
        backend.register_pool(KV_POOL, HostPoolView(host), num_parts=2)
        self._report_stored = report_stored
        self._lock = threading.Lock()
        self._results = TrafficResults()
        self._held: set[int] = set()  # ids of reads reported held, to release when they settle
        self._worker = StorageWorker(backend, max(1, backend.capabilities.max_batch_pages),
                                     on_change=self._ended)

    def store(self, keys: Sequence[str], slots: Sequence[int]) -> None:
        self._worker.backup(keys, slots, payload=None)

    def fetch(self, keys: Sequence[str], slots: Sequence[int], gen: int) -> None:
        self._worker.prefetch(keys, slots, payload=_Fetch(gen))

    def take(self) -> TrafficResults:
        """What finished since the last call."""
        self._worker.finished_backups()  # told through `_ended` already: not kept twice
        with self._lock:
            out, self._results = self._results, TrafficResults()
        return out

    @property
    def quarantined(self) -> int:
        """Reads whose storage call may still write their slots."""
        with self._lock:
            return len(self._held)

    def close(self, timeout_s: float = 30.0) -> None:
        """Cancel what has not started, let the running call end, stop."""
        self._worker.close(timeout_s)

    def _ended(self, op: StorageOp) -> None:
        """The worker's word on `op` (its thread): it ended, or a quarantined one settled."""
        if not isinstance(op.payload, _Fetch):
            if op.settled:  # a write quarantined until now votes only once its call returned
                self._stored(op)
            return
        tickets = [Ticket(slot, op.payload.gen) for slot in op.host_pages]
        done = op.done_pages
        with self._lock:
            if op.id in self._held:  # the call that held them returned
                self._held.discard(op.id)
                self._results.released.extend(tickets[done:])
                return
            self._results.fetched.extend(tickets[:done])
            if op.settled:
                self._results.failed_fetches.extend(tickets[done:])
            else:
                self._held.add(op.id)
                self._results.held_fetches.extend(tickets[done:])

    def _stored(self, op: StorageOp) -> None:
        done = op.done_pages
        if done:
            self._report_stored(op.keys[:done])
        if done < op.num_pages:
            log.warning("writing %d pages to L3 failed (%s)", op.num_pages - done,
                        op.error or "not written")
        with self._lock:
            self._results.stored.extend(op.host_pages)
            self._results.failed_stores.update(op.host_pages[done:])
