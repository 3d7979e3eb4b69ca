"""Mooncake Store clients whose master was gone when their backend closed: parked, reused,
and bounded in number.

Why park: closing such a client makes Mooncake retry the gone master while holding the GIL,
which stops every thread of the process (measured, Mooncake 0.3.13: 11 to 15 s for a master
whose port refuses connections, longer when its host drops packets; a rank re-attaching to a
restarted master stalled its instance). A parked client stays open and unused instead, and
keeps its memory: the pages of its global segment that objects were written into, and its
local buffer. What bounds that memory, in one process:

- Parking unregisters the buffers its backend registered (the transfer engine's own
  bookkeeping, no call to the master), so a parked client pins none of the host pools it
  served, and they can be freed.
- A master back at the same address heals its parked clients: Mooncake pings its master
  once a second, and reconnects and remounts its segment when it answers again (measured:
  the client's health flag stays OK until the first ping after the master went, turns bad,
  and is OK again at the first ping that reaches the new master). A client therefore counts
  as healed when its flag is OK at least FLAG_STALE_S after it was parked and the master's
  port accepts a connect. The next connection to that address with the same setup takes
  such a client instead of setting up another one (waiting up to HEAL_WAIT_S for it to
  heal), and any other healed parked client is closed then (~1 s, its master answers).
- At most MAX_PARKED_CLIENTS stay parked: parking one more closes the oldest, which blocks
  the process as above, once. Parked clients therefore hold at most
  MAX_PARKED_CLIENTS x (global_segment_size_bytes + local_buffer_size_bytes), whatever
  the number of master restarts (`held_bytes` counts it).

Mooncake still tears parked clients down as the process exits, retrying their masters
there: a process that parked one exits some 10 to 30 s later than it would.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple

from kvtier.backends.mooncake_master import port_open

log = logging.getLogger(__name__)

OK = 0
MAX_PARKED_CLIENTS = 4
HEAL_WAIT_S = 3.0  # Mooncake pings its master once a second; a restart heals in 1-2 s
FLAG_STALE_S = 1.5  # a client's health flag may still say OK this long after its master went
POLL_S = 0.1
PROBE_TIMEOUT_S = 0.5  # a TCP connect to a parked client's master: is it back?


class ClientSetup(NamedTuple):
    """What a client was set up with besides its master: a reused one must match."""

    local_hostname: str  # without a port, a free one is picked (mooncake_backend._client_name)
    metadata_server: str
    segment_bytes: int
    buffer_bytes: int
    protocol: str
    device_name: str


class ParkedClient(NamedTuple):
    store: Any  # a MooncakeDistributedStore
    master_address: str
    setup: ClientSetup


def close_client(store: Any) -> None:
    """Close a client whose master answers: ~1 s (the module docstring says why not others)."""
    try:
        store.close()
    except Exception as exc:  # noqa: BLE001 - nothing left to do with a client that won't close
        log.warning("mooncake client close failed: %s", exc)


def master_answers(client: ParkedClient) -> bool:
    """Does the client's master answer it again? Its own health flag (stale for a second
    or two after the master goes) and a TCP connect to the master's port."""
    host, _, port = client.master_address.rpartition(":")
    return (client.store.health_check() == OK
            and port_open(host, int(port), timeout_s=PROBE_TIMEOUT_S))


class _Entry(NamedTuple):
    client: ParkedClient
    parked_at: float  # time.monotonic()


class ParkedClients:
    """The parked clients of this process, oldest first (the module docstring)."""

    def __init__(self, limit: int = MAX_PARKED_CLIENTS, heal_wait_s: float = HEAL_WAIT_S,
                 answers: Callable[[ParkedClient], bool] = master_answers,
                 flag_stale_s: float = FLAG_STALE_S) -> None:
        self.limit, self.heal_wait_s, self.flag_stale_s = limit, heal_wait_s, flag_stale_s
        self._answers = answers
        self._parked: list[_Entry] = []
        self._lock = threading.Lock()

    def park(self, client: ParkedClient, buffers: Iterable[int] = ()) -> None:
        """Keep `client` instead of closing it, its `buffers` unregistered; close those
        whose master answers again, then the oldest while more than `limit` are kept."""
        for ptr in buffers:
            rc = client.store.unregister_buffer(ptr)
            if rc != OK:
                log.warning("mooncake: a parked client could not unregister %#x (code %d)",
                            ptr, rc)
        with self._lock:
            self._parked.append(_Entry(client, time.monotonic()))
            count = len(self._parked)
        log.warning("mooncake: not closing a client whose master %s is gone (its close would "
                    "block this process); %d client(s) parked, at most %d",
                    client.master_address, count, self.limit)
        self._close_healed()
        with self._lock:
            excess = self._parked[:max(0, len(self._parked) - self.limit)]
            del self._parked[:len(excess)]
        for old in excess:
            log.warning("mooncake: closing the oldest parked client (master %s, gone): this "
                        "process stalls while Mooncake retries that master",
                        old.client.master_address)
            close_client(old.client.store)

    def take(self, master_address: str, setup: ClientSetup) -> Any | None:
        """A parked client of `master_address` with `setup` whose master answers it again
        (waiting up to `heal_wait_s` for one to heal), taken out of the park; else None.
        Other parked clients whose master answers again are closed."""
        mine = [e for e in self._snapshot()
                if (e.client.master_address, e.client.setup) == (master_address, setup)]
        deadline = time.monotonic() + self.heal_wait_s
        while mine:
            healed = next((e for e in mine if self._healed(e)), None)
            if healed is not None and self._claim(healed):
                log.info("mooncake: reusing the client parked when the master at %s went; "
                         "it answers again", master_address)
                self._close_healed()
                return healed.client.store
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        self._close_healed()
        return None

    def held_bytes(self) -> int:
        """The segment and buffer bytes that parked clients hold (at most)."""
        return sum(e.client.setup.segment_bytes + e.client.setup.buffer_bytes
                   for e in self._snapshot())

    def stores(self) -> list[Any]:
        return [e.client.store for e in self._snapshot()]

    def __len__(self) -> int:
        with self._lock:
            return len(self._parked)

    def _healed(self, entry: _Entry) -> bool:
        """Does the entry's master answer it again (its flag no longer stale)?"""
        return (time.monotonic() >= entry.parked_at + self.flag_stale_s
                and self._answers(entry.client))

    def _claim(self, entry: _Entry) -> bool:
        with self._lock:
            if entry not in self._parked:  # another connection took or closed it
                return False
            self._parked.remove(entry)
            return True

    def _close_healed(self) -> None:
        """Close the parked clients whose master answers again: quick, and frees them."""
        for entry in [e for e in self._snapshot() if self._healed(e)]:
            if self._claim(entry):
                log.info("mooncake: closing a parked client, its master %s answers again",
                         entry.client.master_address)
                close_client(entry.client.store)

    def _snapshot(self) -> list[_Entry]:
        with self._lock:
            return list(self._parked)
