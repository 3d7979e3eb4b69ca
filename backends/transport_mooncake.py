"""The Mooncake transport: Mooncake's transfer engine, peer to peer, no master.

Each endpoint is a `mooncake.engine.TransferEngine` initialized with metadata "P2PHANDSHAKE"
(no metadata server: a peer's session id "host:port" is enough to reach it), protocol "tcp"
here ("rdma" where NICs exist). A write is ONE `batch_transfer_sync_write(session, local
addrs, remote addrs, lengths)`; nonzero is failure. A read is ONE `batch_transfer_sync_read`
with the same arguments in the same order (local addrs are then the destinations): a reader
pulls pages from a peer's host pool, so a peer that dies or hangs never writes into the
reader's memory. Connections are Mooncake's own: it opens the peer's segment on the first
transfer and caches it by session id.

Mooncake facts this relies on (mooncake-transfer-engine-non-cuda 0.3.13, measured here):
- What an endpoint listens on: two TCP sockets, and no option binds either to one address
  (MC_TCP_BIND_ADDRESS, MC_LEGACY_RPC_PORT_BINDING, MC_USE_TENT change neither): the P2P
  handshake listener on 0.0.0.0 (its port, in 15000-17000, is get_rpc_port() and the session
  id's port) and the TCP transport's data listener on `::` (another port in that range).
  `local_hostname` only decides the address peers are told to dial (127.0.0.1 by default, so
  nothing here ever dials out of the machine). Firewall 15000-17000 to the cluster network.
- The TARGET checks every remote range against its registered buffers and rejects the write
  or read ("remote-supplied address ... is not within any registered buffer"): the call
  returns -1 at once. Local buffers need no registration over TCP (kvtier checks them anyway).
- A closed or dead peer fails the call at once (connection refused / broken pipe). A HUNG
  peer (stopped process) blocks the sync call until Mooncake's own timeout, MC_TRANSFER_TIMEOUT
  (default 30 s, at least 5) plus 1 ns per byte, busy-polling a core: so a write() or read()
  whose `timeout_s` is shorter than that runs the call in a helper thread and gives up after
  `timeout_s`; the thread (and the engine, and the local memory it reads or writes) stays
  until Mooncake's timeout ends the call: after a read's TransportTimeout its destination rows
  may still change until then. A call that may wait as long as Mooncake does runs directly:
  a prefill rank's hand-off right after its forward moved ~0.8 GB/s through the helper
  thread against ~1.15 GB/s called directly (bare calls ~1.2 GB/s, same run).
- Two engines in one process work. Closing one (dropping it) takes ~1 s (Mooncake's).
- Mooncake prints every INFO line to stderr: MC_LOG_LEVEL defaults to WARNING here (set it
  in a Ray actor's runtime_env to reach Mooncake before it loads).
- Throughput, 64 MiB in 2,048 scattered rows of 32 KiB, writer and decode peer in two
  processes over TCP on loopback, medians of 9 alternating runs on the shared 2-core machine:
  write() 0.9-1.5 GB/s, raw_write() 0.9-1.55 GB/s (ratio 0.89-1.02). The sync call's busy
  poll and the peer's TCP threads share the 2 cores, hence the spread; the helper thread
  costs write() ~3% against a direct call. Reads, the same rows the other way, best of 3 in
  each of 3 runs of the transport test: read() 0.74-0.94 GB/s, raw_read() 0.78-0.95 GB/s
  (writes in the same runs: 0.71-0.93).
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import threading

import numpy as np

from kvtier.backends.transport_base import (TransportDirection, TransportEndpoint, TransportTimeout,
                                            TransportError, TransportUnavailable, Rows, Target)
from kvtier.backends.transport_regions import Region
from kvtier.policies import Transport

log = logging.getLogger(__name__)
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")

LOOPBACK = "127.0.0.1"
METADATA = "P2PHANDSHAKE"
_KEEP: list = []  # engines with a transfer still running at close: kept until exit
_CALLS = {TransportDirection.WRITE: "batch_transfer_sync_write",  # the engine's method names
          TransportDirection.READ: "batch_transfer_sync_read"}
_UNAVAILABLE_HINT = ("`pip install mooncake-transfer-engine-non-cuda` (or mooncake-transfer-"
                     "engine where CUDA is present; on Debian also apt-get install libibverbs1), "
                     "or use the nixl transport (`pip install nixl`)")


def native_timeout_s(nbytes: int) -> float:
    """How long Mooncake's sync call waits at most before it fails by itself."""
    try:
        base = float(os.environ.get("MC_TRANSFER_TIMEOUT", "30"))
    except ValueError:
        base = 30.0
    return max(5.0, base) + nbytes * 1e-9


class MooncakeEndpoint(TransportEndpoint):
    kind = Transport.MOONCAKE

    def __init__(self, name: str, local_hostname: str = LOOPBACK, protocol: str = "tcp",
                 device_name: str = "") -> None:
        super().__init__(name)
        try:
            from mooncake.engine import TransferEngine
        except ImportError as exc:
            raise TransportUnavailable(f"mooncake.engine cannot be imported ({exc}); "
                                       f"{_UNAVAILABLE_HINT}") from exc
        engine = TransferEngine()
        rc = engine.initialize(local_hostname, METADATA, protocol, device_name)
        if rc != 0:
            raise TransportUnavailable(
                f"Mooncake's transfer engine did not start on {local_hostname!r} over {protocol} "
                f"(code {rc}): local_hostname must be an address of this machine and the "
                "protocol one it supports (tcp everywhere, rdma with RDMA NICs)")
        self._engine = engine
        host = local_hostname  # "host" or "host:port" (an IPv6 literal has more colons)
        host = host.partition(":")[0] if host.count(":") == 1 else host
        self.session_id = f"{host}:{engine.get_rpc_port()}"
        self._pool_lock = threading.Lock()
        self._pool = self._new_pool()
        self._stuck: list[concurrent.futures.Future] = []

    def _new_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        return concurrent.futures.ThreadPoolExecutor(1, f"mooncake-transport-{self.unique_name}")

    # ---- memory and address -----------------------------------------------------------
    def _register(self, region: Region) -> None:
        location = "*" if region.device == "cpu" else region.device  # "*": Mooncake finds it
        rc = self._engine.register_memory(region.addr, region.nbytes, location)
        if rc != 0:
            raise TransportUnavailable(f"Mooncake cannot register {region.nbytes} bytes of "
                                       f"{region.device} memory (code {rc}); GPU memory needs the "
                                       "CUDA build (mooncake-transfer-engine)")

    def _deregister(self, region: Region) -> None:
        with self._pool_lock:
            running = any(not f.done() for f in self._stuck)
        if not running:  # else a transfer may still move its rows: kept until close
            self._unregister(region)

    def _unregister(self, region: Region) -> None:
        rc = self._engine.unregister_memory(region.addr)
        if rc != 0:
            log.warning("Mooncake could not unregister %#x (code %d)", region.addr, rc)

    def _blob(self) -> bytes:
        return self.session_id.encode()

    def _connect(self, target: Target) -> object:
        session = target.address.blob.decode("ascii", "replace")
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit():
            raise TransportError(f"peer {target.address.name} gave Mooncake session "
                                 f"{session!r}, not host:port; its address is corrupt")
        return session  # Mooncake opens (and caches) the peer's segment on first use

    # ---- writes and reads --------------------------------------------------------------
    def _transfer(self, direction: TransportDirection, target: Target, rows: Rows,
                  timeout_s: float) -> None:
        args = (target.conn, rows.local[:, 0].tolist(), rows.remote[:, 0].tolist(),
                rows.local[:, 1].tolist())
        nbytes = int(rows.local[:, 1].sum())
        what = (f"{direction.verb} of {len(rows.local)} rows {direction.toward} "
                f"{target.address.name} ({target.conn})")
        if timeout_s >= native_timeout_s(nbytes):
            rc = self._call(direction)(*args)  # Mooncake gives up in time: no helper thread
        else:
            with self._pool_lock:
                future = self._pool.submit(self._call(direction), *args)
            try:
                rc = future.result(timeout=timeout_s)
            except concurrent.futures.TimeoutError:
                self._abandon(future)
                landing = ("; its destination rows here may still change until then"
                           if direction is TransportDirection.READ else "")
                raise TransportTimeout(
                    f"a Mooncake {what} did not finish in {timeout_s:.2f} s: the peer may be "
                    "hung or overloaded (Mooncake keeps trying for up to "
                    f"{native_timeout_s(nbytes):.0f} s, MC_TRANSFER_TIMEOUT{landing})") from None
        if rc != 0:
            raise TransportError(
                f"Mooncake failed a {what} (code {rc}): the peer closed, died or hung, or a "
                "remote row is outside the memory it registered; Mooncake's log on stderr "
                "says which")

    def _call(self, direction: TransportDirection):
        """The engine's sync call for `direction` (ClosedError once closed)."""
        self._check_open()
        return getattr(self._engine, _CALLS[direction])

    def _abandon(self, future: concurrent.futures.Future) -> None:
        """Leave a call that outlived its timeout to its thread; later calls get a new one."""
        with self._pool_lock:
            self._stuck = [f for f in self._stuck if not f.done()] + [future]
            self._pool.shutdown(wait=False)
            self._pool = self._new_pool()

    def _raw_transfer(self, direction: TransportDirection, target: Target, local: np.ndarray,
                      remote: np.ndarray, timeout_s: float) -> None:
        rc = self._call(direction)(target.conn, local[:, 0].tolist(), remote[:, 0].tolist(),
                                   local[:, 1].tolist())
        if rc != 0:
            raise TransportError(f"Mooncake failed a raw {direction.verb} (code {rc})")

    # ---- lifetime ----------------------------------------------------------------------
    def _close(self) -> None:
        with self._pool_lock:
            self._pool.shutdown(wait=False)
            running = [f for f in self._stuck if not f.done()]
        if running:
            log.error("%d Mooncake transport transfers of %s are still running; keeping its engine "
                      "and registrations until they end", len(running), self.unique_name)
            _KEEP.append(self._engine)
        else:
            for region in self._regions.regions:
                self._unregister(region)
        self._peers.clear()
        self._engine = None  # the engine goes now (~1 s): its listeners close
