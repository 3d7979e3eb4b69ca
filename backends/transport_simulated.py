"""The simulated transport: memmove between endpoints of one process (unit tests only).

Endpoints live in a process-global registry (unique name -> registered regions). A write or
a read checks, under the registry lock, that the peer is still open and that every remote row
lies in what it registered now (its memory may have gone since its address was taken), then
copies row by row with ctypes.memmove: local -> remote for a write, remote -> local for a read
(a reader pulling pages from a peer's host pool). Host memory only: a GPU pointer would crash
memmove.
"""
from __future__ import annotations

import ctypes
import os
import threading

import numpy as np

from kvtier.backends.transport_base import (TransportDirection, TransportEndpoint,
                                            TransportError, Rows, Target)
from kvtier.backends.transport_regions import Region, RegionTable
from kvtier.errors import ConfigError
from kvtier.policies import Transport

_ENDPOINTS: dict[str, RegionTable] = {}
_LOCK = threading.Lock()


class SimulatedEndpoint(TransportEndpoint):
    kind = Transport.SIMULATED

    def __init__(self, name: str) -> None:
        super().__init__(name)
        with _LOCK:
            _ENDPOINTS[self.unique_name] = RegionTable()

    def _register(self, region: Region) -> None:
        if region.device != "cpu":
            raise ConfigError(f"the simulated transport moves host memory only, not "
                              f"{region.device}; use the nixl transport for GPU memory")
        self._publish()

    def _deregister(self, region: Region) -> None:
        self._publish()

    def _publish(self) -> None:
        with _LOCK:  # publish a copy: writers read it under the lock, never half-updated
            _ENDPOINTS[self.unique_name] = RegionTable(self._regions.regions)

    def _blob(self) -> bytes:
        return b""

    def _connect(self, target: Target) -> object:
        if target.address.pid != os.getpid():
            raise TransportError(f"the simulated peer {target.address.name} lives in "
                                 f"process {target.address.pid}: simulated endpoints "
                                 "reach only their own process; use nixl or mooncake")
        return target.address.name

    def _transfer(self, direction: TransportDirection, target: Target, rows: Rows,
                  timeout_s: float) -> None:
        self._copy(direction, target, rows.local, rows.remote)

    def _raw_transfer(self, direction: TransportDirection, target: Target, local: np.ndarray,
                      remote: np.ndarray, timeout_s: float) -> None:
        self._copy(direction, target, local, remote)

    def _copy(self, direction: TransportDirection, target: Target, local: np.ndarray,
              remote: np.ndarray) -> None:
        with _LOCK:  # the peer cannot close (and free its memory) during the copy
            live = _ENDPOINTS.get(target.conn)
            if live is None:
                raise TransportError(f"the simulated peer {target.conn} is closed: ask the "
                                     "peer for a fresh address")
            outside = live.first_outside(remote, live.locate(remote))
            if outside:
                raise TransportError(f"remote {outside} of peer {target.conn} now")
            src, dst = direction.source_and_destination(local, remote)
            for d, s, n in zip(dst[:, 0].tolist(), src[:, 0].tolist(), local[:, 1].tolist()):
                ctypes.memmove(d, s, n)

    def _close(self) -> None:
        with _LOCK:
            _ENDPOINTS.pop(self.unique_name, None)
