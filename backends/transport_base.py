"""The contract of a transport between two processes' registered memory: one endpoint per rank,
one-sided writes (the prefill -> decode KV hand-off) and reads (peer-to-peer L2).

A decode rank registers its KV pool tensors and hands `address()` to the prefill rank (through
the engine's bootstrap message; the bytes are opaque). The prefill rank `write()`s rows
`(addr, nbytes)` of its own registered memory into rows of the peer's: row i of `local` lands
in row i of `remote`, whole. Pages never travel through Ray's object store.

`read()` is the same transfer the other way: row i of the PEER's registered memory (`remote`)
lands in row i of this endpoint's (`local`). A reader pulls pages from a peer's host pool
instead of having them pushed: the reader controls its own memory, so a peer that dies or
hangs never writes into pages the reader has meanwhile reused. One caveat, the reader's own
library: after a read's TransportTimeout, NIXL has cancelled the transfer (or keeps it, and
its agent, when it cannot), while Mooncake's abandoned call may still land its rows until
Mooncake's own timeout (backends/transport_mooncake.py).

What every transport shares lives here (the template around `_transfer`, one code path for
both directions, `TransportDirection`): row validation (shapes, equal sizes, local rows inside
local registrations, remote rows inside the peer's advertised registrations), the per-address
peer cache, counters, close. Each transport module adds only its library calls. `raw_write`
and `raw_read` are the benchmark's baselines: the transport's same library calls with none of
this around them.

Errors: a caller bug (mismatched rows, a local row outside registered memory) raises
CacheUsageError; anything the peer or the wire causes raises TransportError (the
engine then recomputes or retries the request), TransportTimeout when `timeout_s` ran out.
"""
from __future__ import annotations

import abc
import enum
import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from typing import NamedTuple

import numpy as np

from kvtier.backends import transport_address
from kvtier.backends.transport_address import PeerAddress
from kvtier.backends.transport_regions import Region, RegionTable, as_rows, parse_device
from kvtier.errors import CacheUsageError, ClosedError, TransferError
from kvtier.policies import Transport

log = logging.getLogger(__name__)
MAX_PEERS = 1024  # cached peer addresses (and their connections) per endpoint, least recent go
_IDS = itertools.count()


class TransportDirection(str, enum.Enum):
    """Which way a one-sided transfer moves rows; the value is NIXL's operation name."""

    WRITE = "WRITE"  # row i of this endpoint's memory -> row i of the peer's
    READ = "READ"  # row i of the peer's memory -> row i of this endpoint's

    @property
    def verb(self) -> str:
        return self.value.lower()

    @property
    def toward(self) -> str:
        """How the peer is named after the verb: "a write of 3 rows to P", "... from P"."""
        return "to" if self is TransportDirection.WRITE else "from"

    def source_and_destination(self, local, remote):
        """(source, destination) of a transfer between `local` and `remote` rows."""
        return (local, remote) if self is TransportDirection.WRITE else (remote, local)


class TransportMove(NamedTuple):
    """What one write() or read() moved."""

    bytes: int
    descriptors: int
    seconds: float




class TransportCounters(NamedTuple):
    """Monotonic totals of one endpoint's write() calls, then of its read() calls (raw_write
    and raw_read are not counted). A failure is a call that raised TransportError."""

    bytes: int  # written
    descriptors: int
    writes: int
    failures: int  # of writes
    read_bytes: int = 0
    read_descriptors: int = 0
    reads: int = 0
    read_failures: int = 0


class TransportError(TransferError):
    """A transport's write or read failed: the peer is gone or unreachable, its address is stale,
    or a remote row lies outside what the peer registered. The message says what to check."""


class TransportTimeout(TransportError):
    """A transport's write or read did not finish within its timeout (the peer may be hung or
    overloaded)."""


class TransportUnavailable(TransferError):
    """The transport cannot be set up in this process (library missing or refusing)."""


class Target(NamedTuple):
    """A decoded peer address plus this endpoint's connection to it."""

    address: PeerAddress
    table: RegionTable
    conn: object  # the library's handle: NIXL agent name, Mooncake session id, ...


class Rows(NamedTuple):
    """A validated write or read: both row arrays and the region index of every row on each side."""

    local: np.ndarray
    remote: np.ndarray
    local_region: np.ndarray
    remote_region: np.ndarray


class TransportEndpoint(abc.ABC):
    kind: Transport

    def __init__(self, name: str) -> None:
        self.name = name
        # unique in the process and across processes: what peers (and NIXL) know us by
        self.unique_name = f"{name}-{os.getpid()}-{next(_IDS)}"
        self._regions = RegionTable()
        self._peers: OrderedDict[bytes, Target] = OrderedDict()
        self._peer_lock = threading.RLock()  # the cache's order and its connections
        self._count_lock = threading.Lock()
        # per direction: bytes, descriptors, calls, failures (TransportCounters' order)
        self._totals = {d: [0, 0, 0, 0] for d in TransportDirection}
        self.closed = False

    # ---- memory ------------------------------------------------------------------------
    def register(self, addr: int, nbytes: int, device: str = "cpu") -> None:
        """Let peers write into and read from (and this side move rows to and from)
        `nbytes` at `addr`: a pool tensor's data_ptr() and nbytes. Idempotent per (addr,
        nbytes). Register before address()."""
        self._check_open()
        kind, index = parse_device(device)
        region = Region(int(addr), int(nbytes), "cpu" if kind == "cpu" else f"cuda:{index}")
        if self._regions.add(region):
            try:
                self._register(region)
            except BaseException:
                self._forget(region)
                raise

    def deregister(self, addr: int, nbytes: int) -> None:
        """Undo `register(addr, nbytes)` before that memory is freed or reused. Nothing when
        it is not registered or the endpoint is closed (close released everything). A peer
        holding an older address() still names the region: its moves there fail."""
        region = next((r for r in self._regions.regions
                       if (r.addr, r.nbytes) == (int(addr), int(nbytes))), None)
        if self.closed or region is None:
            return
        self._forget(region)
        self._deregister(region)

    def address(self) -> bytes:
        """Opaque bytes a peer passes to write() and read(): how to reach this endpoint's memory."""
        self._check_open()
        return transport_address.encode(PeerAddress(self.kind, self.unique_name, os.getpid(),
                                                    tuple(self._regions.regions), self._blob()))

    # ---- writes and reads --------------------------------------------------------------
    def write(self, peer: bytes, local: np.ndarray, remote: np.ndarray,
              timeout_s: float) -> TransportMove:
        """Write row i of `local` (this side's registered memory) into row i of `remote` (the
        peer's), all rows as one transfer; blocks until done or `timeout_s` has passed."""
        return self._move(TransportDirection.WRITE, peer, local, remote, timeout_s)

    def read(self, peer: bytes, local: np.ndarray, remote: np.ndarray,
             timeout_s: float) -> TransportMove:
        """Read row i of `remote` (the peer's registered memory) into row i of `local` (this
        side's), all rows as one transfer; blocks until done or `timeout_s` has passed."""
        return self._move(TransportDirection.READ, peer, local, remote, timeout_s)

    def raw_write(self, peer: bytes, local: np.ndarray, remote: np.ndarray,
                  timeout_s: float) -> float:
        """The benchmark baseline of write(): the transport's library calls for the same rows,
        without kvtier's checks or counters (the peer must be reachable; rows uint64 (n, 2)).
        Returns seconds; raises TransportError on failure."""
        return self._raw_move(TransportDirection.WRITE, peer, local, remote, timeout_s)

    def raw_read(self, peer: bytes, local: np.ndarray, remote: np.ndarray,
                 timeout_s: float) -> float:
        """The benchmark baseline of read(), as raw_write is of write()."""
        return self._raw_move(TransportDirection.READ, peer, local, remote, timeout_s)

    def _move(self, direction: TransportDirection, peer: bytes, local: np.ndarray,
              remote: np.ndarray, timeout_s: float) -> TransportMove:
        self._check_open()
        t0 = time.perf_counter()
        if not timeout_s > 0:
            raise CacheUsageError(f"timeout_s must be a positive number of seconds: {timeout_s}")
        rows = self._local_rows(direction, local, remote)
        nbytes = int(rows.local[:, 1].sum())
        try:
            target = self._target(peer)
            rows = rows._replace(remote_region=self._remote_regions(target, rows.remote))
            if len(rows.local):
                self._transfer(direction, target, rows, float(timeout_s))
        except TransportError:
            self._count(direction, 0, 0, 0, 1)
            raise
        self._count(direction, nbytes, len(rows.local), 1, 0)
        return TransportMove(nbytes, len(rows.local), time.perf_counter() - t0)

    def _raw_move(self, direction: TransportDirection, peer: bytes, local: np.ndarray,
                  remote: np.ndarray, timeout_s: float) -> float:
        target = self._peers.get(peer) or self._target(peer)
        t0 = time.perf_counter()
        self._raw_transfer(direction, target, local, remote, float(timeout_s))
        return time.perf_counter() - t0

    def disconnect(self, peer: bytes) -> None:
        """Forget `peer` (and drop this side's connection to it); a later call reconnects."""
        with self._peer_lock:
            target = self._peers.pop(bytes(peer), None)
            if target is not None and all(t.conn != target.conn for t in self._peers.values()):
                self._disconnect(target)

    @property
    def counters(self) -> TransportCounters:
        with self._count_lock:
            return TransportCounters(*self._totals[TransportDirection.WRITE],
                                     *self._totals[TransportDirection.READ])

    # ---- lifetime ----------------------------------------------------------------------
    def close(self) -> None:
        """Release the library's resources (idempotent). Writes and reads after close raise
        ClosedError."""
        if self.closed:
            return
        self.closed = True
        self._close()

    def __enter__(self) -> "TransportEndpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.unique_name!r}, {len(self._regions)} regions, "
                f"{'closed' if self.closed else 'open'})")

    # ---- helpers -----------------------------------------------------------------------
    def _forget(self, region: Region) -> None:
        self._regions = RegionTable(r for r in self._regions.regions if r != region)

    def _check_open(self) -> None:
        if self.closed:
            raise ClosedError(f"the {self.kind} transport endpoint {self.unique_name} is closed; "
                              "open a new one")

    def _count(self, direction: TransportDirection, nbytes: int, descriptors: int, calls: int,
               failures: int) -> None:
        with self._count_lock:
            totals = self._totals[direction]
            for i, v in enumerate((nbytes, descriptors, calls, failures)):
                totals[i] += v

    def _local_rows(self, direction: TransportDirection, local: np.ndarray,
                    remote: np.ndarray) -> Rows:
        local, remote = as_rows(local, "local"), as_rows(remote, "remote")
        if local.shape != remote.shape:
            src, dst = direction.source_and_destination("local", "remote")
            raise CacheUsageError(f"{len(local)} local rows but {len(remote)} remote rows: "
                                  f"row i of {src} is copied to row i of {dst}")
        if not np.array_equal(local[:, 1], remote[:, 1]):
            i = int(np.flatnonzero(local[:, 1] != remote[:, 1])[0])
            raise CacheUsageError(f"row {i}: {int(local[i, 1])} local bytes but "
                                  f"{int(remote[i, 1])} remote bytes; each row pair moves "
                                  "one region whole, so sizes must match")
        idx = self._regions.locate(local)
        outside = self._regions.first_outside(local, idx)
        if outside:
            pool = "source" if direction is TransportDirection.WRITE else "destination"
            raise CacheUsageError(f"local {outside} of this endpoint: register the {pool} pool "
                                  f"before the {direction.verb}")
        empty = np.zeros(0, np.int64)
        return Rows(local, remote, idx, empty)

    def _remote_regions(self, target: Target, remote: np.ndarray) -> np.ndarray:
        idx = target.table.locate(remote)
        outside = target.table.first_outside(remote, idx)
        if outside:
            raise TransportError(
                f"remote {outside} of peer {target.address.name}: the peer's page addresses "
                "do not match the memory it registered (stale address or wrong pool)")
        return idx

    def _target(self, peer: bytes) -> Target:
        """The cached target of `peer`, decoded and connected on first use."""
        key = bytes(peer)
        with self._peer_lock:
            target = self._peers.get(key)
            if target is not None:
                self._peers.move_to_end(key)
                return target
            return self._add_target(key)

    def _add_target(self, key: bytes) -> Target:
        try:
            address = transport_address.decode(key)
        except ValueError as exc:
            raise TransportError(f"cannot reach this peer: {exc}; pass the bytes the "
                                 "peer endpoint's address() returned") from exc
        if address.kind != self.kind:
            raise TransportError(f"the peer {address.name} is a {address.kind} endpoint; "
                                 f"a {self.kind} endpoint cannot reach it (both ranks "
                                 "must use the same transport)")
        target = Target(address, address.table(), None)
        target = target._replace(conn=self._connect(target))
        self._peers[key] = target
        while len(self._peers) > MAX_PEERS:
            self.disconnect(next(iter(self._peers)))
        return target

    # ---- what each transport implements --------------------------------------------------
    @abc.abstractmethod
    def _register(self, region: Region) -> None: ...

    @abc.abstractmethod
    def _deregister(self, region: Region) -> None: ...

    @abc.abstractmethod
    def _blob(self) -> bytes: ...

    @abc.abstractmethod
    def _connect(self, target: Target) -> object: ...

    def _disconnect(self, target: Target) -> None:
        """Drop the library's connection to `target` (nothing by default)."""

    @abc.abstractmethod
    def _transfer(self, direction: TransportDirection, target: Target, rows: Rows,
                  timeout_s: float) -> None:
        """Move every row of `rows` in `direction` as one library transfer; raise
        TransportError (TransportTimeout after `timeout_s`) unless it finished."""

    @abc.abstractmethod
    def _raw_transfer(self, direction: TransportDirection, target: Target, local: np.ndarray,
                      remote: np.ndarray, timeout_s: float) -> None:
        """The same library calls as `_transfer`, rows unchecked (the benchmark baseline)."""

    @abc.abstractmethod
    def _close(self) -> None: ...
