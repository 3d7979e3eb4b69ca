"""The `mooncake` L3 backend: page parts as Mooncake Store objects, moved zero-copy.

- The master is either given (`master_address`) or started here on `master_host` (loopback
  for "auto": a backend opened on its own serves this process) and stopped at close
  (backends/mooncake_master.py).
- What a client listens on (measured, Mooncake 0.3.13, tcp, P2PHANDSHAKE): two sockets, and
  Mooncake offers no option to bind either to one address (MC_TCP_BIND_ADDRESS,
  MC_RDMA_BIND_ADDRESS and MC_LEGACY_RPC_PORT_BINDING change neither): the transfer engine's
  P2P handshake listener (transfer_engine_impl.cpp, a port in 15000-17000) on 0.0.0.0, and
  the TcpTransport data listener (tcp_transport.cpp, another port in that range) on `::`.
  `local_hostname` only decides the address the client registers for peers to dial. Keep
  those ports firewalled to the cluster's network (tests/backends pin this down).
- Objects are one per owned KV head and part of a page. Each host pool is registered with
  the client ONCE; a batch is then a few `batch_put_from` / `batch_get_into` calls at once
  (lanes, below), each over per-object pointers into the pool.
- Writes ask `batch_is_exist` first and put only the missing objects (a page's bytes never
  change under its key). A page is ok only when every one of its objects is.
- Reads always check sizes (Mooncake returns the bytes it copied). With `verify_checksums`
  each object is its part's bytes followed by an 8-byte trailer, the part's xxh3_64
  (little-endian), gathered on put from the pool and a registered array of trailers and
  scattered back on get (`batch_put_from_multi_buffers` / `batch_get_into_multi_buffers`),
  and checked after the copy. A wrong size or checksum is a miss, counted in
  `corrupt_objects`, and the page's objects go. Without it objects are the part's bytes
  alone, so a reader whose `verify_checksums` differs from the writer's finds objects 8
  bytes off its size: a miss, counted in `extra["foreign_objects"]`, left in place (all
  backends of a namespace must agree; `exists` still counts such pages).
- A batch goes in up to LANES concurrent calls, each lane a run of whole pages (one call
  copies its objects one after another; concurrent calls copy on both cores: measured in
  docs/benchmarks.md, "Mooncake in lanes"). A verified lane goes in calls of about
  READ_CALL_BYTES or WRITE_CALL_BYTES, and the lane's own thread hashes each call's parts
  just after its get or just before its put, while those bytes are still in cache (xxhash
  releases the GIL); an unverified lane is one call.
- A dead master makes calls misses/failures, never exceptions or hangs, and is counted
  (backends/mooncake_master_guard.py says why and how). A master restarted elsewhere
  (a new address) needs a new backend: detach and attach. Closing a backend whose master is
  gone parks its client instead of closing it, its buffers unregistered; a connection to a
  master back at that address reuses it, and at most MAX_PARKED_CLIENTS (4) are kept per
  process, so parked clients hold at most 4 x (global_segment_size_bytes +
  local_buffer_size_bytes) however often masters restart (backends/mooncake_parked.py).
- Every call to the client has a deadline, `call_timeout_s` (backends/bounded_calls.py: a
  peer whose link is cut holds a Mooncake call far longer). Past it `exists` is a miss, a
  delete removes nothing, and a read or write that may still touch its host pages raises
  PagesStillInUse with the call's Future: the storage worker fails the op and keeps its
  pages quarantined until the call returns (never published: its pages are not reported).
  At most MAX_STUCK_CALLS calls run past their deadline; meanwhile further calls are not
  started: `exists` misses, and a read or write raises StorageUnavailable (the op fails,
  and a read does not tell the directory its pages are missing). Mooncake's own per-step
  timeouts (TCP progress and status, handshake connect) are set to the deadline, rounded up
  to whole seconds (its unit), unless the environment sets them, so that a stuck call
  returns soon after the deadline on an open connection (on a new one Mooncake tries the
  handshake once per object: a stuck call can last until the link is back).
- Each put asks for `replica_num` copies on different segments (`copies`: 1 unless the
  namespace resolved "auto" to 2 for a cluster on 2+ hosts). Mooncake reads the first
  complete copy and does not fall back to another, so while a cut host's segment is still
  mounted a read of its objects times out (a miss); once the master drops the segment
  (its client's TTL, 2 s) the other copy serves them.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import os
import threading
from concurrent import futures
from typing import Any, Callable, NamedTuple

import numpy as np
import xxhash

from kvtier.backends.base import (Capabilities, PagesStillInUse, PoolRegistration,
                                  StorageBackend, StorageTarget, StorageUnavailable,
                                  TransferResult)
from kvtier.backends.bounded_calls import BoundedCalls, CallOutcome, CallState
from kvtier.backends.mooncake_master import (LOOPBACK, MooncakeMaster, default_master_host,
                                             free_port, port_open)
from kvtier.backends.mooncake_master_guard import OK, MasterGuard
from kvtier.backends.mooncake_parked import (MAX_PARKED_CLIENTS, ClientSetup, ParkedClient,
                                             ParkedClients, close_client)
from kvtier.errors import CacheUsageError
from kvtier.policies import StorageBackendKind
from kvtier.storage_options import MooncakeOptions

log = logging.getLogger(__name__)
# Mooncake writes every INFO line to stderr; keep its warnings and errors unless told otherwise.
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

BUFFER_TOO_SMALL = -600
OBJECT_NOT_FOUND = -704
TRANSFER_FAIL = -800  # also what a multi-buffer get into more bytes than the object gets
NO_ANSWER = -10_000  # kvtier's: the call passed its deadline, or was refused meanwhile
SKIPPED = -10_001  # kvtier's: not sent, the master stopped answering earlier in the batch
# Mooncake's own waits (whole seconds), set to the call deadline unless the environment has
# them: the TCP transport's progress and status-frame deadlines (read at each transfer) and
# the handshake connect timeout (read once per process, when the first client starts).
MOONCAKE_TIMEOUT_ENV = ("MC_TCP_PROGRESS_TIMEOUT_SEC", "MC_TCP_STATUS_TIMEOUT_SEC",
                        "MC_HANDSHAKE_CONNECT_TIMEOUT")
SUM_BYTES = 8  # a verified object's trailer: its part's xxh3_64, little-endian
# Concurrent calls per batch, and the bytes of a verified lane's calls (module docstring;
# measured in docs/benchmarks.md, "Mooncake in lanes"): a get's parts are checked right after
# it, while most of them are still in the CPU's last-level cache; each put costs two RPCs
# to the master, so a verified lane hashes and puts larger calls.
LANES = 3
LANE_BYTES = 6 << 20  # at least this much a lane: a smaller batch is quicker in one call
READ_CALL_BYTES = 24 << 20
WRITE_CALL_BYTES = 64 << 20


# Mooncake ErrorCode values this backend meets (mooncake-store/include/types.h).
_ERRORS = {-1: "internal error", -200: "no space left (puts past ~90% of the segments fail)",
           -600: "invalid parameters, or a buffer too small for the object",
           -704: "object not found", -706: "object has a lease", -800: "transfer failed",
           -900: "RPC to the master failed", -901: "RPC to the master timed out",
           NO_ANSWER: "no answer within call_timeout_s",
           SKIPPED: "not sent: the master stopped answering earlier in the batch"}
DEFAULT_METADATA = "P2PHANDSHAKE"  # no metadata server needed (see mooncake_master.py)


def describe(rc: int) -> str:
    return f"code {rc} ({_ERRORS.get(rc, 'see ErrorCode in Mooncake types.h')})"


def _client_name(local_hostname: str) -> str:
    """`host:port` with a free port: one setup attempt instead of Mooncake's 20 (~90 s)."""
    if ":" in local_hostname:  # host:port given (or an IPv6 literal: left to Mooncake)
        return local_hostname
    try:
        return f"{local_hostname}:{free_port(local_hostname)}"
    except OSError as exc:
        raise StorageUnavailable(f"storage_options local_hostname {local_hostname!r} is not an "
                                 f"address of this machine ({exc}); use 127.0.0.1 or this "
                                 "machine's IP") from exc


def client_setup(options: MooncakeOptions) -> ClientSetup:
    """What `connect` sets a client up with, besides its master."""
    return ClientSetup(options.local_hostname or LOOPBACK,
                       options.metadata_server or DEFAULT_METADATA,
                       options.global_segment_size_bytes, options.local_buffer_size_bytes,
                       options.protocol.value, options.device_name)


def connect(options: MooncakeOptions, master_address: str) -> Any:
    """A set-up MooncakeDistributedStore client, or StorageUnavailable saying what to check:
    one parked when this master went, if it is back (backends/mooncake_parked.py), else new."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        raise StorageUnavailable(
            f"mooncake.store cannot be imported ({exc}); install mooncake-transfer-engine "
            "(`make` does; on Debian also apt-get install libibverbs1)") from exc
    host, _, port = master_address.rpartition(":")
    if not host or not port.isdigit():
        raise StorageUnavailable(f"storage_options master_address {master_address!r} must be "
                                 "host:port (the master's --rpc_address and --rpc_port)")
    if not port_open(host, int(port), timeout_s=min(2.0, options.start_timeout_s)):
        raise StorageUnavailable(
            f"cannot reach the Mooncake master at {master_address}: check that mooncake_master "
            "runs there with that --rpc_address/--rpc_port, or leave master_address unset so "
            f"kvtier starts its own (a master on {LOOPBACK} serves one host only: with ranks on "
            "several hosts, set master_host to an address of the namespace actor's node)")
    setup = client_setup(options)
    parked = PARKED_CLIENTS.take(master_address, setup)
    if parked is not None:
        return parked
    bound_mooncake_waits(options.call_timeout_s)
    store = MooncakeDistributedStore()
    rc = store.setup(_client_name(setup.local_hostname), setup.metadata_server,
                     setup.segment_bytes, setup.buffer_bytes, setup.protocol,
                     setup.device_name, master_address)
    if rc != OK:
        close_client(store)
        raise StorageUnavailable(
            f"Mooncake client setup against master {master_address} failed: {describe(rc)}. "
            f"Check that metadata_server {setup.metadata_server!r} is what that master's "
            "clients use (P2PHANDSHAKE, or http://host:port/metadata for a master with an HTTP "
            "metadata server), that local_hostname is an address of this machine, and that "
            "global_segment_size_bytes fits in free memory")
    return store


def bound_mooncake_waits(call_timeout_s: float) -> None:
    """Mooncake's per-step timeouts no longer than the call deadline (MOONCAKE_TIMEOUT_ENV).
    Process-wide: the first backend of a process sets them; the environment's own win."""
    seconds = str(max(1, math.ceil(call_timeout_s)))
    for name in MOONCAKE_TIMEOUT_ENV:
        os.environ.setdefault(name, seconds)


def replicate_config(copies: int) -> Any:
    """What each put asks of the master: `copies` replicas on different segments."""
    from mooncake.store import ReplicateConfig
    config = ReplicateConfig()
    config.replica_num = copies
    return config


# Clients whose master was gone when their backend closed (backends/mooncake_parked.py).
PARKED_CLIENTS = ParkedClients(MAX_PARKED_CLIENTS)


class _PoolMap:
    """Object names and byte addresses of one registered pool's objects, precomputed.

    A page is one object per owned KV head and part (the registration's `slots`). Why
    precompute: a torch view and a validated name per object cost ~20 us, 7-15% of a batch's
    time at memory speed. Names are `head + key + tail` (keys are checked by the base class);
    an object's address is its slot's base plus page * page stride, which is verified here
    against `reg.view` (a pool where it is not falls back to views). With verification,
    `sums` holds each (page, slot)'s trailer, registered with the client like the pool.
    """

    def __init__(self, target: StorageTarget, reg: PoolRegistration, sums: np.ndarray | None):
        dummy = "0" * 64
        self.heads, self.tails = [], []
        for slot in reg.slots:
            name = target.object_name(reg.name, dummy, slot.head, slot.part)
            at = name.rfind(dummy)
            self.heads.append(name[:at])
            self.tails.append(name[at + 64:])
        self.reg, self.num_slots = reg, len(reg.slots)
        self.sums = sums
        self.pool, self.num_pages = reg.pool, reg.pool.num_pages
        # A view holds the pool's memory: a call past its deadline keeps this map, so the
        # memory it may still write stays mapped even if the pool is closed meanwhile.
        self.memory = reg.view(0, 0)
        self.start, self.end = self.pool.data_ptr(), self.pool.data_ptr() + self.pool.nbytes
        # The pool's bytes by address, for hashing parts in place (kept mapped by `memory`).
        self.bytes = memoryview((ctypes.c_ubyte * self.pool.nbytes).from_address(self.start))
        self.bases = [reg.view(0, i).data_ptr() for i in range(self.num_slots)]
        self.part_bytes = reg.view(0, 0).numel()
        self.page_stride = reg.view(1, 0).data_ptr() - self.bases[0] if self.num_pages > 1 else 0
        self.affine = self._check_affine()
        # What an object of this pool weighs as this backend writes it, and as a backend
        # whose verify_checksums differs writes it (module docstring).
        verify = sums is not None
        self.object_bytes = self.part_bytes + (SUM_BYTES if verify else 0)
        self.foreign_bytes = self.part_bytes + (0 if verify else SUM_BYTES)

    def _check_affine(self) -> bool:
        """Do sample pages match the affine map, and does it stay inside the pool's memory?"""
        last, view = self.num_pages - 1, self.reg.view
        samples = {0, min(1, last), last // 2, last}
        matches = all(self._affine_ptr(p, q) == view(p, q).data_ptr()
                      and view(p, q).numel() == self.part_bytes
                      for p in samples for q in range(self.num_slots))
        inside = all(self._inside(self._affine_ptr(p, q))
                     for p in (0, last) for q in range(self.num_slots))
        if not (matches and inside):
            log.info("mooncake backend: pool addresses are not affine; using page views")
        return matches and inside

    def _inside(self, ptr: int) -> bool:
        return self.start <= ptr <= self.end - self.part_bytes

    def _affine_ptr(self, page: int, slot: int) -> int:
        return self.bases[slot] + page * self.page_stride

    def _view_ptr(self, page: int, slot: int) -> int:
        ptr = self.reg.view(page, slot).data_ptr()
        if not self._inside(ptr):
            raise CacheUsageError(f"page {page} of pool {self.reg.name!r} lies outside the "
                                  "memory the pool registered (data_ptr, nbytes)")
        return ptr

    def names(self, key: str) -> list[str]:
        return [h + key + t for h, t in zip(self.heads, self.tails)]

    def batch(self, keys: list[str], pages: list[int]) -> "_Batch":
        """Every object of every page, page by page, in `slots` order."""
        if pages and (min(pages) < 0 or max(pages) >= self.num_pages):
            raise CacheUsageError(f"host pages must be in 0..{self.num_pages - 1}, got "
                                  f"{min(pages)}..{max(pages)}")
        n, count = self.num_slots, len(keys)
        slots = list(range(n))
        if self.affine:  # addresses in one numpy pass
            at = np.asarray(pages, dtype=np.int64)[:, None]
            ptrs = (at * self.page_stride + np.asarray(self.bases, dtype=np.int64)).ravel()
        else:
            ptrs = np.asarray([self._view_ptr(p, i) for p in pages for i in slots], np.int64)
        sums = (np.asarray(pages, dtype=np.int64)[:, None] * n + np.arange(n)).ravel()
        return _Batch([s for s in range(count) for _ in slots],
                      [h + key + t for key in keys for h, t in zip(self.heads, self.tails)],
                      ptrs.tolist(), [self.part_bytes] * (count * n), sums.tolist())

    # ---- verified objects: part bytes + trailer --------------------------------------------
    def gather(self, b: "_Batch", lo: int, hi: int) -> tuple[list[list[int]], list[list[int]]]:
        """Buffers and sizes of objects lo..hi-1 for the multi-buffer calls: part, trailer."""
        at = self.sums.ctypes.data
        return ([[p, at + s * SUM_BYTES] for p, s in zip(b.ptrs[lo:hi], b.sums[lo:hi])],
                [[n, SUM_BYTES] for n in b.sizes[lo:hi]])

    def digest(self, ptr: int, size: int) -> int:
        return xxhash.xxh3_64_intdigest(self.bytes[ptr - self.start:ptr - self.start + size])

    def seal(self, b: "_Batch", lo: int, hi: int) -> None:
        """The trailers of objects lo..hi-1 (about to be put): their parts' xxh3_64."""
        self.sums[b.sums[lo:hi]] = [self.digest(p, n) for p, n in zip(b.ptrs[lo:hi],
                                                                      b.sizes[lo:hi])]

    def mismatched(self, b: "_Batch", indices: list[int]) -> list[int]:
        """Of objects `indices` (just read), those whose part's xxh3_64 is not the trailer
        read with it."""
        if not indices:
            return []
        stored = self.sums[[b.sums[i] for i in indices]].tolist()
        return [i for i, want in zip(indices, stored)
                if self.digest(b.ptrs[i], b.sizes[i]) != want]


class _Batch(NamedTuple):
    """Parallel lists, as the batch calls take them: object i belongs to page slots[i]."""

    slots: list[int]
    names: list[str]
    ptrs: list[int]
    sizes: list[int]  # part bytes, without a trailer
    sums: list[int]  # the object's trailer slot in its map's `sums` (verified)

    def pick(self, indices: list[int]) -> "_Batch":
        return _Batch(*([column[i] for i in indices] for column in self))

    def lanes(self, count: int, call_bytes: float, lane_bytes: int = 0
              ) -> list[list[tuple[int, int]]]:
        """Object ranges [lo, hi) of whole pages: up to `count` lanes of about equal bytes,
        at least `lane_bytes` each (one lane for a smaller batch) and at least a page each,
        each cut into calls of about `call_bytes` (at least one page). Every object is in
        exactly one range, in order."""
        ends = [i + 1 for i in range(len(self.slots))
                if i + 1 == len(self.slots) or self.slots[i + 1] != self.slots[i]]
        pages = list(zip([0] + ends[:-1], ends))
        sizes = [sum(self.sizes[lo:hi]) for lo, hi in pages]
        total = sum(sizes)
        count = min(count, len(pages), max(1, total // lane_bytes) if lane_bytes else count)
        groups: list[list[int]] = [[] for _ in range(count)]
        done = 0
        for k, size in enumerate(sizes):  # page k goes to the lane its first byte falls in
            groups[min(count - 1, done * count // max(total, 1))].append(k)
            done += size
        lanes = []
        for group in groups:
            if not group:
                continue
            calls, lo, size = [], pages[group[0]][0], 0
            for k in group:
                size += sizes[k]
                if size >= call_bytes or k == group[-1]:
                    calls.append((lo, pages[k][1]))
                    lo, size = pages[k][1], 0
            lanes.append(calls)
        return lanes


class MooncakeBackend(StorageBackend):
    kind = StorageBackendKind.MOONCAKE
    capabilities = Capabilities(zero_copy=True, shared=True, persistent=False, verified=False,
                                bounded=True)

    def __init__(self, options: MooncakeOptions, target: StorageTarget) -> None:
        super().__init__(target)
        self.options = options
        self.verify = options.verify_checksums
        self.capabilities = dataclasses.replace(type(self).capabilities, verified=self.verify)
        self.master: MooncakeMaster | None = None
        self._maps: dict[str, _PoolMap] = {}
        self._buffers: list[int] = []  # what this backend registered with the client
        try:
            address = options.master_address
            if address is None:
                self.master = MooncakeMaster(options.start_timeout_s,
                                             host=default_master_host(options))
                address = self.master.address
            self.store = connect(options, address)
        except BaseException:
            if self.master is not None:
                self.master.stop()
            raise
        self.master_address = address
        self.copies = options.copies
        self.replicate = replicate_config(self.copies)
        self.calls = BoundedCalls(options.call_timeout_s, name="kvtier-mooncake")
        self.lane_count, self.lane_bytes = LANES, LANE_BYTES
        self.read_call_bytes, self.write_call_bytes = READ_CALL_BYTES, WRITE_CALL_BYTES
        # A batch's first lane runs on the caller's thread, the others here.
        self._lanes = futures.ThreadPoolExecutor(max(1, LANES - 1),
                                                 thread_name_prefix="kvtier-mooncake")
        self.counters.extra.update(calls_timed_out=0, calls_refused=0, calls_stuck=0,
                                   foreign_objects=0)
        self._warned_foreign = False  # foreign objects are logged once as a warning
        self.guard = MasterGuard(address, self.master, self.store.health_check, describe,
                                 self.counters.extra)

    # ---- registration --------------------------------------------------------------------
    def _register(self, reg: PoolRegistration) -> None:
        self._register_buffer(reg.pool.data_ptr(), reg.pool.nbytes, f"host pool {reg.name!r}")
        sums = None
        if self.verify:
            # Trailers are zero-copy too: slot (page, object) of a registered array.
            sums = np.zeros(reg.pool.num_pages * len(reg.slots), dtype="<u8")
            self._register_buffer(sums.ctypes.data, sums.nbytes, f"checksums of {reg.name!r}")
        self._maps[reg.name] = _PoolMap(self.target, reg, sums)

    def _register_buffer(self, ptr: int, nbytes: int, what: str) -> None:
        rc = self.store.register_buffer(ptr, nbytes)
        if rc == OK:
            self._buffers.append(ptr)  # unregistered if the client is parked
        else:
            raise StorageUnavailable(
                f"Mooncake could not register the {what} ({nbytes} bytes): {describe(rc)}; "
                "with rdma, check the device name and the locked-memory limit (ulimit -l)")

    def _names(self, reg: PoolRegistration, keys: list[str]) -> list[str]:
        m = self._maps[reg.name]
        return [n for k in keys for n in m.names(k)]

    # ---- calls into the client -----------------------------------------------------------
    def _call(self, fn: Callable[..., list[int]], n: int, *args: Any,
              holds: _PoolMap | None = None) -> list[int]:
        """One batch call within `call_timeout_s`; a client exception becomes a failure of
        every object, not a crash, and so does a call past its deadline, unless it `holds`
        host pages it may still touch: then PagesStillInUse (module docstring)."""
        outcome = self.calls.run(_holding, holds, fn, *args)
        if outcome.state is not CallState.DONE:
            self._note_no_answer(outcome, fn, n, holds)
            return [NO_ANSWER] * n
        if outcome.error is not None:  # the engine's errors are misses here
            log.warning("mooncake %s failed: %s", _name(fn), outcome.error)
            return [-1] * n
        out = list(outcome.value)
        self.guard.observe(out)
        return out if len(out) == n else [-1] * n

    def _note_no_answer(self, outcome: CallOutcome, fn: Callable, n: int,
                        holds: _PoolMap | None) -> None:
        extra = self.counters.extra
        extra.update(calls_timed_out=self.calls.timed_out, calls_refused=self.calls.refused,
                     calls_stuck=self.calls.stuck)
        if outcome.state is CallState.REFUSED:
            if holds is not None:  # a transfer: fail the op (a miss would say "not stored")
                raise StorageUnavailable(
                    f"mooncake {_name(fn)} not started: {extra['calls_stuck']} earlier calls "
                    "are still running past call_timeout_s (an unreachable segment?)")
            return  # never started: nothing touched
        log.warning("mooncake %s of %d objects passed call_timeout_s (%.1f s); %d call(s) "
                    "still running", _name(fn), n, self.options.call_timeout_s,
                    extra["calls_stuck"])
        if holds is not None:
            raise PagesStillInUse(
                f"mooncake {_name(fn)} of {n} objects did not return within call_timeout_s "
                f"({self.options.call_timeout_s} s) and may still use its host pages (a "
                "segment whose host is unreachable?)", pending=outcome.pending)

    def _in_lanes(self, b: _Batch, call: Callable[[int, int], list[int]], call_bytes: float,
                  seal: Callable[[int, int], None] | None = None,
                  check: Callable[[int, int, list[int]], list[int]] | None = None,
                  ) -> tuple[list[int], list[int]]:
        """The objects of `b` in lanes (`_Batch.lanes`), each on a thread of its own, its calls
        in order: `seal(lo, hi)` just before `call(lo, hi)` (it hashes what the call puts) or
        `check(lo, hi, codes)` just after (it hashes what the call got). Returns the codes in
        object order and what the checks returned. Once a lane raises the others start no
        further call, and every lane has ended when this returns or raises: PagesStillInUse
        if any call may still touch its pages, else the first error."""
        stop = threading.Event()

        def lane(spans: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
            rcs: list[int] = []
            bad: list[int] = []
            try:
                for lo, hi in spans:
                    if stop.is_set() or self.guard.down:  # so would every further call be
                        rcs += [SKIPPED] * (hi - lo)
                        continue
                    if seal:
                        seal(lo, hi)
                    got = call(lo, hi)
                    rcs += got
                    if check:
                        bad += check(lo, hi, got)
            except BaseException:
                stop.set()
                raise
            return rcs, bad

        lanes = b.lanes(self.lane_count, call_bytes, self.lane_bytes)
        if len(lanes) <= 1:
            return lane(lanes[0]) if lanes else ([], [])
        others = [self._lanes.submit(lane, spans) for spans in lanes[1:]]
        first: futures.Future = futures.Future()
        try:
            first.set_result(lane(lanes[0]))
        except BaseException as exc:  # noqa: BLE001 - raised below, once every lane has ended
            first.set_exception(exc)
        futures.wait(others)
        done = [first, *others]
        _raise_lane_errors([f.exception() for f in done])
        results = [f.result() for f in done]
        return [rc for rcs, _ in results for rc in rcs], [i for _, bad in results for i in bad]

    def _put(self, m: _PoolMap, b: _Batch) -> list[int]:
        """Put the objects of `b` in lanes; verified, each call's parts hashed just before."""
        if not self.verify:
            def put(lo: int, hi: int) -> list[int]:
                return self._call(self.store.batch_put_from, hi - lo, b.names[lo:hi],
                                  b.ptrs[lo:hi], b.sizes[lo:hi], self.replicate, holds=m)
            return self._in_lanes(b, put, math.inf)[0]

        def put_verified(lo: int, hi: int) -> list[int]:
            ptrs, sizes = m.gather(b, lo, hi)
            return self._call(self.store.batch_put_from_multi_buffers, hi - lo, b.names[lo:hi],
                              ptrs, sizes, self.replicate, holds=m)
        return self._in_lanes(b, put_verified, self.write_call_bytes,
                              seal=lambda lo, hi: m.seal(b, lo, hi))[0]

    def _fetch(self, m: _PoolMap, b: _Batch) -> tuple[list[int], list[int]]:
        """Get the objects of `b` in lanes: their codes, and (verified) those whose checksum
        failed, each call's parts checked just after it."""
        if not self.verify:
            def get(lo: int, hi: int) -> list[int]:
                return self._call(self.store.batch_get_into, hi - lo, b.names[lo:hi],
                                  b.ptrs[lo:hi], b.sizes[lo:hi], holds=m)
            return self._in_lanes(b, get, math.inf)

        def get_verified(lo: int, hi: int) -> list[int]:
            ptrs, sizes = m.gather(b, lo, hi)
            return self._call(self.store.batch_get_into_multi_buffers, hi - lo,
                              b.names[lo:hi], ptrs, sizes, holds=m)

        def check(lo: int, hi: int, got: list[int]) -> list[int]:
            return m.mismatched(b, [lo + i for i, rc in enumerate(got) if rc == m.object_bytes])
        return self._in_lanes(b, get_verified, self.read_call_bytes, check=check)

    # ---- the interface -------------------------------------------------------------------
    def _per_page(self, reg: PoolRegistration) -> int:
        return len(reg.slots)

    def _present(self, reg: PoolRegistration, keys: list[str]) -> list[bool]:
        if not keys or not self.guard.usable():
            return [False] * len(keys)
        names, n = self._names(reg, keys), self._per_page(reg)
        found = self._call(self.store.batch_is_exist, len(names), names)
        return [all(f == 1 for f in found[i:i + n]) for i in range(0, len(names), n)]

    def _set(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]) -> TransferResult:
        if not keys or not self.guard.usable():
            return TransferResult([False] * len(keys), 0)
        m = self._maps[reg.name]
        b = m.batch(keys, host_pages)
        found = self._call(self.store.batch_is_exist, len(b.names), b.names)
        if self.guard.down or NO_ANSWER in found:  # that RPC failed or hung: so would a put
            return TransferResult([False] * len(keys), 0)
        todo = b.pick([i for i, f in enumerate(found) if f != 1])
        need = sorted(set(todo.slots))
        self.counters.write_skipped_existing += len(keys) - len(need)
        try:
            rcs = self._put(m, todo) if todo.names else []
        except StorageUnavailable:  # past the deadline, or not started
            self.counters.write_failures += len(keys)  # the op fails: none is reported
            raise
        ok, moved = [True] * len(keys), [0] * len(keys)
        for slot, size, rc in zip(todo.slots, todo.sizes, rcs):
            if rc != OK:
                ok[slot] = False
            else:
                moved[slot] += size
        failed = [rc for rc in rcs if rc != OK]
        if failed:
            log.warning("mooncake backend: %d of %d objects not stored, first %s", len(failed),
                        len(rcs), describe(failed[0]))
        return TransferResult(ok, sum(n for n, good in zip(moved, ok) if good))

    def _get(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]) -> TransferResult:
        if not keys or not self.guard.usable():
            return TransferResult([False] * len(keys), 0)
        m = self._maps[reg.name]
        b = m.batch(keys, host_pages)
        try:
            rcs, mismatched = self._fetch(m, b)
        except StorageUnavailable:  # past the deadline, or not started
            self.counters.read_misses += len(keys)  # the prefetch gets none of them
            raise
        failed = [i for i, rc in enumerate(rcs) if rc != m.object_bytes]
        ok = [True] * len(keys)
        for i in failed:
            ok[b.slots[i]] = False
        bad: dict[int, int] = {}  # slot -> corrupt objects found
        for i in self._wrong_sized(m, b, failed, rcs) + mismatched:
            ok[b.slots[i]] = False
            bad[b.slots[i]] = bad.get(b.slots[i], 0) + 1
        if bad:
            self._drop_corrupt(reg, [keys[s] for s in bad], sum(bad.values()))
        return TransferResult(ok, m.part_bytes * len(reg.slots) * sum(ok))

    def _delete(self, reg: PoolRegistration, keys: list[str]) -> int:
        if not keys or not self.guard.usable():
            return 0
        names, n = self._names(reg, keys), self._per_page(reg)
        # force: Mooncake leases every object it has answered `exists`/`get` for (10 s by
        # default); kvtier's own page leases (the L3 namespace) decide what may be deleted.
        rcs = self._call(self.store.batch_remove, len(names), names, True)
        return sum(any(rc == OK for rc in rcs[i:i + n]) for i in range(0, len(names), n))

    # ---- verification --------------------------------------------------------------------
    def _wrong_sized(self, m: _PoolMap, b: _Batch, failed: list[int],
                     rcs: list[int]) -> list[int]:
        """Of the objects `failed` to read, those of a wrong size (rather than absent or
        unreachable); those of the size the other verify_checksums writes are counted in
        `foreign_objects` instead, misses left in place (module docstring)."""
        sizes = {i: rcs[i] for i in failed if rcs[i] >= 0}  # copied an object that is short
        # Longer than the buffers (-600), or shorter than a multi-buffer get's (-800, also a
        # transfer that failed): ask the master what the object weighs.
        ask = [i for i in failed if rcs[i] in (BUFFER_TOO_SMALL, TRANSFER_FAIL)]
        if ask:
            names = [b.names[i] for i in ask]
            sizes.update(zip(ask, self._call(self._object_sizes, len(names), names)))
        foreign = [i for i, size in sizes.items() if size == m.foreign_bytes]
        if foreign:
            self.counters.extra["foreign_objects"] += len(foreign)
            say = log.debug if self._warned_foreign else log.warning
            say("mooncake backend: %d object(s) of %d bytes where %d were expected (written "
                "with verify_checksums=%s): misses; every backend of a namespace needs the "
                "same verify_checksums", len(foreign), m.foreign_bytes, m.object_bytes,
                not self.verify)
            self._warned_foreign = True
        return sorted(i for i, size in sizes.items()
                      if size >= 0 and size not in (m.object_bytes, m.foreign_bytes))

    def _object_sizes(self, names: list[str]) -> list[int]:
        """Each object's size in bytes as the master lists it (one RPC), or a negative code."""
        listed = self.store.batch_get_replica_desc(names)
        out = []
        for name in names:
            memory = [r for r in listed.get(name, ()) if r.is_memory_replica()]
            if memory:
                out.append(memory[0].get_memory_descriptor().buffer_descriptor.size)
            else:  # absent, or on disk only
                out.append(self.store.get_size(name) if name in listed else OBJECT_NOT_FOUND)
        return out

    def _drop_corrupt(self, reg: PoolRegistration, keys: list[str], objects: int) -> None:
        self.counters.corrupt_objects += objects
        log.warning("mooncake backend: %d corrupt object(s) in %d page(s) of %r; removing them",
                    objects, len(keys), reg.name)
        # force: the bytes are wrong for every reader, lease or not (readers verify too).
        names = self._names(reg, keys)
        self._call(self.store.batch_remove, len(names), names, True)

    # ---- lifetime ------------------------------------------------------------------------
    def _close(self) -> None:
        # A call past its deadline may still use the client: it is closed when they return.
        parked = ParkedClient(self.store, self.master_address, client_setup(self.options))
        guard, buffers = self.guard, self._buffers

        def close_or_park() -> None:
            if guard.gone():  # its close would block the process (backends/mooncake_parked.py)
                PARKED_CLIENTS.park(parked, buffers)
            else:
                close_client(parked.store)
        self.calls.close(close_or_park)
        self._lanes.shutdown(wait=True, cancel_futures=True)
        if self.master is not None:
            self.master.stop()

    def __repr__(self) -> str:
        own = self.master is not None
        return f"MooncakeBackend(master={self.master_address}, own={own}, verify={self.verify})"


def _raise_lane_errors(errors: list[BaseException | None]) -> None:
    """What a batch's lanes raised, as one error: PagesStillInUse if any lane's call may
    still touch its pages (its `pending` done once every such call has returned; none if
    any cannot tell), else the first error; nothing if no lane raised."""
    raised = [e for e in errors if e is not None]
    stuck = [e for e in raised if isinstance(e, PagesStillInUse)]
    if len(stuck) > 1:
        pending = [e.pending for e in stuck]
        raise PagesStillInUse(f"{len(stuck)} mooncake calls of one batch may still use their "
                              f"host pages; the first: {stuck[0]}",
                              pending=None if None in pending else _when_all(pending)
                              ) from stuck[0]
    if stuck or raised:
        raise (stuck or raised)[0]


def _when_all(pending: list[futures.Future]) -> futures.Future:
    """A Future done (with None) once every one of `pending` is."""
    out: futures.Future = futures.Future()
    out.set_running_or_notify_cancel()
    left = [len(pending)]
    lock = threading.Lock()

    def one_done(_: futures.Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last:
            out.set_result(None)
    for f in pending:
        f.add_done_callback(one_done)
    return out


def _holding(keep: object, fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` with `keep` (a pool's map) referenced for as long as the call runs."""
    return fn(*args)


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", repr(fn))
