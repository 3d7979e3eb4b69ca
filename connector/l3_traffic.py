"""One worker's L3 traffic: its KV heads of pages written to and read from the namespace's
storage, on a thread of its own so that no step waits for storage (docs/vllm.md).

The scheduler side never reuses a slot while a rank still reads it for a write, nor loads a
slot before every rank read it in (kvtier.connector.l2_index), so the thread works on the host
pool without locks. Each finished slot is handed back once, through `take`, for the step's
report. The objects are kvtier's (one per page, KV head and part), named by the backend from
the page key and the head's global index, so a page written at one TP size is read at another.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from kvtier.backends.base import KV_POOL, StorageBackend
from kvtier.connector.job_thread import JobThread

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
    fetched: list[int] = field(default_factory=list)  # slots read in
    failed_fetches: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Job:
    write: bool  # True: slots -> storage; False: storage -> slots
    keys: tuple[str, ...]
    slots: tuple[int, ...]


class L3Traffic:
    """Writes and reads of one rank's objects, in order, on one thread."""

    def __init__(self, backend: StorageBackend, host: torch.Tensor,
                 report_stored: Callable[[Sequence[str]], None]) -> None:
        self.backend = backend
        backend.register_pool(KV_POOL, HostPoolView(host), num_parts=2)
        self._report_stored = report_stored
        self._batch = max(1, backend.capabilities.max_batch_pages)
        self._lock = threading.Lock()
        self._results = TrafficResults()
        self._jobs = JobThread("kvtier-l3", self._run)

    def store(self, keys: Sequence[str], slots: Sequence[int]) -> None:
        self._jobs.put(_Job(True, tuple(keys), tuple(slots)))

    def fetch(self, keys: Sequence[str], slots: Sequence[int]) -> None:
        self._jobs.put(_Job(False, tuple(keys), tuple(slots)))

    def take(self) -> TrafficResults:
        """What finished since the last call."""
        with self._lock:
            out, self._results = self._results, TrafficResults()
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued work, then stop."""
        self._jobs.close(timeout_s)

    def _run(self, job: _Job) -> None:
        for start in range(0, len(job.keys), self._batch):
            part = _Job(job.write, job.keys[start:start + self._batch],
                        job.slots[start:start + self._batch])
            self._write(part) if part.write else self._read(part)

    def _write(self, job: _Job) -> None:
        try:
            ok = self.backend.set_from(KV_POOL, list(job.keys), list(job.slots)).ok
        except Exception as exc:  # noqa: BLE001 - a failed write is a later miss, nothing more
            log.warning("writing %d pages to L3 failed (%s: %s)", len(job.keys),
                        type(exc).__name__, exc)
            ok = [False] * len(job.keys)
        written = [key for key, good in zip(job.keys, ok) if good]
        if written:
            self._report_stored(written)
        with self._lock:
            self._results.stored.extend(job.slots)
            self._results.failed_stores.update(s for s, good in zip(job.slots, ok) if not good)

    def _read(self, job: _Job) -> None:
        try:
            ok = self.backend.get_into(KV_POOL, list(job.keys), list(job.slots)).ok
        except Exception as exc:  # noqa: BLE001 - a failed read is a miss: recomputed
            log.warning("reading %d pages from L3 failed (%s: %s)", len(job.keys),
                        type(exc).__name__, exc)
            ok = [False] * len(job.keys)
        with self._lock:
            for slot, good in zip(job.slots, ok):
                (self._results.fetched.append(slot) if good
                 else self._results.failed_fetches.add(slot))
