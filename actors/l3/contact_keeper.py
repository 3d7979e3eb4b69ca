"""One holder rank's peer contact, kept registered with the L3 namespace directory.

A rank that lends its L2 to peers tells the directory how to reach it (`register_peer`: a
`PeerRank`). The directory keeps a holder's contacts under the holder's lease
(tiers/l2_holders.py): they go when the holder is not heard from for HOLDER_TTL_S, or when a
newer start of the same holder name replaces its incarnation. The rank therefore registers
again every RENEW_INTERVAL_S on a thread of its own, which renews the lease too and brings
the contact back after the directory dropped it (the rank was cut off for longer than the
TTL, or the directory restarted). The contact comes from the rank's own process (a vLLM
worker, a kvtier rank actor), where the holder's L2 reporter does not run, so each rank keeps
its own.
"""
from __future__ import annotations

import logging
import threading
from typing import Protocol

from kvtier.messages import PeerRank
from kvtier.tiers.l2_holders import RENEW_INTERVAL_S

log = logging.getLogger(__name__)


class PeerDirectory(Protocol):
    """What the keeper calls: the namespace actor's clients and PageDirectory have it."""

    def register_peer(self, ns: str, holder: str, incarnation: str, rank: PeerRank
                      ) -> object: ...


class ContactKeeper:
    """Registers `rank` of holder `holder` (its start `incarnation`) with `directory` for
    namespace `namespace` now, and again every `interval_s` until `close`."""

    def __init__(self, directory: PeerDirectory, namespace: str, holder: str,
                 incarnation: str, rank: PeerRank, interval_s: float = RENEW_INTERVAL_S
                 ) -> None:
        self.namespace, self.holder, self.incarnation, self.rank = (namespace, holder,
                                                                    incarnation, rank)
        self._directory, self._interval_s = directory, interval_s
        self.renewals = 0  # registrations after the first, answered
        self.failures = 0
        self._ok = True
        # the first registration raises: a rank that cannot lend is misconfigured
        directory.register_peer(namespace, holder, incarnation, rank)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"peer-contact-{holder}-{rank.rank}")
        self._thread.start()

    def renew(self) -> bool:
        """Register again now; False: the directory failed (tried again next interval)."""
        try:
            self._directory.register_peer(self.namespace, self.holder, self.incarnation,
                                          self.rank)
        except Exception as exc:  # noqa: BLE001 - the next renewal registers it again
            self.failures += 1
            if self._ok:  # once per outage
                log.warning("L2 holder %s rank %d: renewing its peer contact failed (%s); "
                            "tried again every %.0f s", self.holder, self.rank.rank, exc,
                            self._interval_s)
            self._ok = False
            return False
        if not self._ok:
            log.info("L2 holder %s rank %d: its peer contact is registered again",
                     self.holder, self.rank.rank)
        self._ok = True
        self.renewals += 1
        return True

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop renewing (the holder's L2 reporter's `close` tells the directory to forget
        the contact; without it the contact expires with the holder's lease)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.renew()
