"""One worker's peer-to-peer L2: its host pool as peers read it, and its reads of theirs, on a
thread of its own so that no step waits for a peer (docs/vllm.md, "Peers").

The pool (`[slots, heads, 2, layers, values]`, kvtier.connector.worker_side) keeps each of
this rank's KV heads of a slot as one run of bytes, K then V, so a peer moves whole head
objects with one-sided reads (tiers/peer_pages.py): an engine of one TP size reads one of
another, each rank the heads it holds. Engines that share pages share a key namespace, and
with it the model, the attention backend and the block size: their pools have one layout.

A read lands in slots the scheduler side reserved for it (FETCHING), which nothing else
touches until every rank reported them; a read whose transport timed out may still write
them, so its slots are reported held at once (a miss) and released only once the transport's
own timeout has surely ended (`TRANSPORT_LINGER_S`): until then the slots are handed to
nothing else (kvtier.connector.l2_index).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from kvtier.connector.job_thread import JobThread
from kvtier.connector.plan import Ticket
from kvtier.errors import ConfigError
from kvtier.messages import PeerContact
from kvtier.tiers.page_exchange import PoolMemory, object_sums
from kvtier.tiers.peer_fetch import TRANSPORT_LINGER_S
from kvtier.tiers.peer_pages import PeerReader
from kvtier.tiers.peer_table import VerifiedSums

log = logging.getLogger(__name__)


class HostPeerPool:
    """A worker's host pool as a `PeerPool` (tiers/peer_pages.py): a head object is one KV
    head's K or V of a slot over every layer; a slot's head keeps K then V in one run."""

    def __init__(self, host: torch.Tensor) -> None:
        if host.dim() != 5 or host.shape[2] != 2 or not host.is_contiguous():
            raise ConfigError(f"a host pool for peers is [slots, heads, 2, layers, values] "
                              f"and contiguous; got {list(host.shape)}")
        self.host = host
        self.object_bytes = host.shape[3] * host.shape[4] * host.element_size()
        # sums of slots a peer read verified, for the worker to list them with (WorkerSide)
        self.sums = VerifiedSums()

    def memory(self) -> PoolMemory:
        return PoolMemory(self.host.data_ptr(), self.host.numel() * self.host.element_size(),
                          self.host.shape[0], "cpu")

    def head_regions(self, base_addr: int, pool_pages: int, pool_heads: int,
                     pages: Sequence[int], heads: Sequence[int]) -> np.ndarray:
        ids = np.asarray(pages, dtype=np.uint64)
        if ids.size and int(ids.max()) >= pool_pages:
            raise ConfigError(f"slot {int(ids.max())} is outside a pool of {pool_pages} slots")
        p = ids[:, None, None]
        h = np.asarray(heads, dtype=np.uint64)[None, :, None]
        part = np.arange(2, dtype=np.uint64)[None, None, :]
        index = (p * np.uint64(pool_heads) + h) * np.uint64(2) + part
        rows = np.empty((index.size, 2), dtype=np.uint64)
        rows[:, 0] = index.reshape(-1) * np.uint64(self.object_bytes) + np.uint64(base_addr)
        rows[:, 1] = self.object_bytes
        return rows

    def head_sums(self, pages: Sequence[int], heads: Sequence[int]) -> tuple[int, ...]:
        slots, pool_heads = self.host.shape[:2]
        objects = self.host.view(torch.uint8).numpy().reshape(slots, pool_heads, -1)
        return object_sums((objects,), pages, heads)

    def verified(self, pages: Sequence[int], sums: Sequence[int]) -> None:
        self.sums.put(pages, sums, self.host.shape[1])


@dataclass
class PeerResults:
    fetched: list[Ticket] = field(default_factory=list)  # read in, whole and verified
    failed: list[Ticket] = field(default_factory=list)  # not read: recomputed
    held: list[Ticket] = field(default_factory=list)  # not read; the transport may still write
    released: list[Ticket] = field(default_factory=list)  # of held ones: it no longer can


@dataclass(frozen=True)
class _Read:
    contact: PeerContact
    keys: tuple[str, ...]
    first_page: int
    slots: tuple[int, ...]
    gen: int

    def tickets(self) -> list[Ticket]:
        return [Ticket(slot, self.gen) for slot in self.slots]


class PeerTraffic:
    """Reads from peers' host pools into this rank's slots, in order, on one thread."""

    def __init__(self, reader: PeerReader) -> None:
        self.reader = reader
        self._lock = threading.Lock()
        self._results = PeerResults()
        self._lingering: list[tuple[float, list[Ticket]]] = []  # (released at, tickets)
        self._jobs = JobThread("kvtier-peers", self._read)

    def fetch(self, contact: PeerContact, keys: Sequence[str], first_page: int,
              slots: Sequence[int], gen: int) -> None:
        """Read the pages keyed `keys` (prompt pages `first_page` on) from `contact`'s host
        pools into `slots`, for the fetch of generation `gen`."""
        self._jobs.put(_Read(contact, tuple(keys), first_page, tuple(slots), gen))

    def take(self) -> PeerResults:
        """What finished since the last call (the slots of a timed-out read released only
        once the transport's timeout has surely ended)."""
        now = time.monotonic()
        with self._lock:
            out, self._results = self._results, PeerResults()
            for _, tickets in [x for x in self._lingering if x[0] <= now]:
                out.released.extend(tickets)
            self._lingering = [x for x in self._lingering if x[0] > now]
        return out

    def close(self, timeout_s: float = 30.0) -> None:
        """Finish the queued reads, then stop; the reader deregisters its table copies."""
        self._jobs.close(timeout_s)
        self.reader.close()

    def _read(self, job: _Read) -> None:
        try:
            read = self.reader.read(job.contact, job.keys, job.first_page, job.slots)
        except Exception as exc:  # noqa: BLE001 - a read that raised is a miss: recomputed
            log.warning("reading %d pages from peer %s failed (%s: %s)", len(job.slots),
                        job.contact.holder, type(exc).__name__, exc)
            with self._lock:
                self._results.failed.extend(job.tickets())
            return
        tickets = job.tickets()
        with self._lock:
            if read.transport_may_write:
                self._results.held.extend(tickets)
                self._lingering.append((time.monotonic() + TRANSPORT_LINGER_S, tickets))
                return
            got = max(0, min(int(read.pages), len(tickets)))
            self._results.fetched.extend(tickets[:got])
            self._results.failed.extend(tickets[got:])
