"""The guard that turns calls to a dead Mooncake master into misses at once.

Why it exists: Mooncake 0.3.13's cached health flag stays OK after its master dies, and every
RPC to a dead master waits ~4.5 s for its timeout (measured). Asking the client alone would
therefore stall each L3 call for seconds. After one failed RPC calls are misses without
asking: for RPC_BACKOFF_S, then for as long as the master's port refuses a TCP connect
(answered at once; PROBE_TIMEOUT_S at most). The first call that succeeds ends the outage.
A master that the backend started and that exited stays down: re-attach to start a new one.

Outages are counted in the backend's `stats().extra`: `master_outages`,
`calls_while_master_down`, `rpc_failures`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from kvtier.backends.mooncake_master import MooncakeMaster, port_open

log = logging.getLogger(__name__)

OK = 0
RPC_ERRORS = (-900, -901)  # RPC_FAIL, RPC_TIMEOUT: the master did not answer
RPC_BACKOFF_S = 2.0
PROBE_TIMEOUT_S = 0.5  # a TCP connect to a master that failed an RPC: is it back?


class MasterGuard:
    """Whether a batch may go to the master at `address`, learned from each call's codes."""

    def __init__(self, address: str, own_master: MooncakeMaster | None,
                 health_check: Callable[[], int], describe: Callable[[int], str],
                 extra: dict) -> None:
        self.address = address
        self._own_master = own_master
        self._health_check = health_check  # the client's cached flag: ~0.3 us
        self._describe = describe  # an error code in words
        self._extra = extra  # the backend's stats().extra, counted here
        extra.update(master_outages=0, calls_while_master_down=0, rpc_failures=0)
        self.down = False  # an RPC failed (or our master exited) and none succeeded since
        self._backoff_until = 0.0
        self._lock = threading.RLock()  # a batch's lanes observe their calls at once

    def usable(self) -> bool:
        """May a batch go to the master? False (counted) while it is known to be gone."""
        why = self._why_down()
        if why is None:
            return True
        self._mark_down(why)
        self._extra["calls_while_master_down"] += 1
        return False

    def observe(self, rcs: list[int]) -> None:
        """Learn from the return codes of a call that reached the client."""
        failed = bool(rcs) and all(rc in RPC_ERRORS for rc in rcs)
        with self._lock:
            if failed:
                # The next call to a dead master would wait ~4.5 s for its RPC to time out:
                # calls are misses until the back-off ends and the master's port opens again.
                self._extra["rpc_failures"] += 1
                self._backoff_until = time.monotonic() + RPC_BACKOFF_S
                self._mark_down(f"an RPC to the master at {self.address} failed: "
                                f"{self._describe(rcs[0])}; L3 misses for now")
            elif self.down:
                log.warning("mooncake backend: the master at %s answers again", self.address)
                self.down = False

    def gone(self) -> bool:
        """Is the master gone (the one this backend started exited, or its port refuses a
        TCP connect)? Asked before closing the client (backends/mooncake_parked.py)."""
        master = self._own_master
        if master is not None:
            return not master.alive()
        return not self._port_open()

    def _why_down(self) -> str | None:
        master = self._own_master
        if master is not None and not master.alive():
            return (f"the master this backend started exited (code {master.proc.returncode});"
                    " every L3 lookup is a miss: re-attach the backend to start a new one")
        if time.monotonic() < self._backoff_until:
            return f"the master at {self.address} failed an RPC; L3 misses for now"
        if self.down and not self._port_open():
            self._backoff_until = time.monotonic() + RPC_BACKOFF_S  # probe again after that
            return f"the master at {self.address} refuses connections; L3 misses for now"
        if self._health_check() != OK:
            return f"the master at {self.address} does not answer; L3 misses for now"
        return None

    def _port_open(self) -> bool:
        host, _, port = self.address.rpartition(":")
        return port_open(host, int(port), timeout_s=PROBE_TIMEOUT_S)

    def _mark_down(self, why: str) -> None:
        with self._lock:
            if not self.down:
                self._extra["master_outages"] += 1
                log.error("mooncake backend: %s", why)
            self.down = True
