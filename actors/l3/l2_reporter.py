"""An instance's L2 holdings, told to the L3 namespace directory off the caller's path.

Both kinds of instance feed one: kvtier's own through its instance server (rank 0's cache
events), vLLM engines through KvtierConnector's scheduler side (its L2 index's changes). The
caller only records what changed (`held`, `dropped`); a thread of the reporter's own sends
the net changes every `interval_s`, one call at a time, so reports reach the directory in
order and a slow or absent directory never delays a step.

The listing is a lease (tiers/l2_holders.py): when nothing changed for `renew_s`
(RENEW_INTERVAL_S) the reporter sends an empty report, which renews it, so a holder that dies
without `close` is dropped from the directory within HOLDER_TTL_S. Every report carries the
holder's incarnation (one per start of the holder), so a report of an earlier start of the
same name is told apart and ignored.

The reporter keeps what the holder holds now, so a report that failed is made good by the
next one: it then replaces the holder's whole listing. The first report replaces too, which
clears what an earlier run of the same holder left behind, and so does the report after one
the directory answered UNLISTED (it had dropped the listing: the lease ran out while the
holder was cut off, or the directory restarted). `close` tells the directory that this
incarnation holds nothing any more.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable, Protocol, Sequence

from kvtier.messages import MAX_HASHES, L2Receipt, L2Standing
from kvtier.tiers.l2_holders import RENEW_INTERVAL_S

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.2
MAX_BACKOFF_S = 5.0  # after failures the reporter waits up to this long between tries


class L2Directory(Protocol):
    """What the reporter calls: the namespace actor's clients and PageDirectory have it."""

    def report_l2(self, ns: str, holder: str, incarnation: str, held: Sequence[str],
                  dropped: Sequence[str] = (), replace: bool = False) -> L2Receipt: ...

    def forget_l2(self, holder: str, incarnation: str) -> int: ...


class L2Reporter:
    """`holder`'s L2 changes of namespace `namespace`, sent to `directory` in the background
    as its start `incarnation`."""

    def __init__(self, directory: L2Directory, namespace: str, holder: str, incarnation: str,
                 interval_s: float = REPORT_INTERVAL_S, renew_s: float = RENEW_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.namespace, self.holder, self.incarnation = namespace, holder, incarnation
        self._directory = directory
        self._interval_s, self._renew_s, self._clock = interval_s, renew_s, clock
        self._lock = threading.Lock()  # guards what is held and changed
        self._sending = threading.Lock()
        self._holding: dict[str, None] = {}  # what the holder holds now, oldest first
        self._changes: dict[str, bool] = {}  # page -> held, since the last report sent
        self._replace = True  # the next report lists everything
        self._stop = threading.Event()
        self.reports = 0  # sent and answered (renewals included)
        self.renewals = 0  # empty reports sent to renew the lease
        self.failures = 0
        self._ok = True  # the last report reached the directory
        self._retired = False  # the directory said a newer incarnation holds the name
        self._last_sent = clock()
        self._thread = threading.Thread(target=self._run, name=f"l2-report-{holder}",
                                        daemon=True)
        self._thread.start()

    def held(self, pages: Iterable[str]) -> None:
        with self._lock:
            for page in pages:
                self._holding[page] = None
                self._changes[page] = True

    def dropped(self, pages: Iterable[str]) -> None:
        with self._lock:
            for page in pages:
                if page in self._holding:
                    del self._holding[page]
                    self._changes[page] = False

    def cleared(self) -> None:
        """The holder lost all of its L2 (new ranks, a flush)."""
        with self._lock:
            self._holding.clear()
            self._changes.clear()
            self._replace = True

    def flush(self) -> bool:
        """Send what changed now, on the caller's thread; False: the directory failed."""
        return self._send()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop reporting; the directory forgets the pages of this incarnation."""
        self._stop.set()
        self._thread.join(timeout_s)
        try:
            self._directory.forget_l2(self.holder, self.incarnation)
        except Exception as exc:  # noqa: BLE001 - its listing stays until its lease runs out
            log.warning("L2 holder %s: the directory did not forget its pages (%s); they "
                        "expire", self.holder, exc)

    def _run(self) -> None:
        wait = self._interval_s
        while not self._stop.wait(wait):  # a directory that fails is tried less often
            wait = self._interval_s if self._send() else min(MAX_BACKOFF_S, 2 * wait)

    def _send(self) -> bool:
        with self._sending:  # one report at a time: `flush` and the thread never overlap
            return self._send_one()

    def _send_one(self) -> bool:
        with self._lock:
            replace = self._replace
            if not replace and not self._changes:
                if self._clock() - self._last_sent < self._renew_s:
                    return True
                held, dropped = [], []  # nothing changed: an empty report renews the lease
            elif replace:
                held, dropped = list(self._holding), []
            else:
                held = [p for p, now in self._changes.items() if now]
                dropped = [p for p, now in self._changes.items() if not now]
            self._changes.clear()
            self._replace = False
        try:
            receipts = [self._directory.report_l2(self.namespace, self.holder, self.incarnation,
                                                  held[start:start + MAX_HASHES],
                                                  dropped[start:start + MAX_HASHES],
                                                  replace=replace and start == 0)
                        for start in range(0, max(len(held), len(dropped), 1), MAX_HASHES)]
        except Exception as exc:  # noqa: BLE001 - the next report lists everything again
            self.failures += 1
            with self._lock:
                self._replace = True
            if self._ok:  # once per outage, not at every try
                log.warning("L2 holder %s: reporting to the namespace directory failed (%s); "
                            "the next report lists all of its pages", self.holder, exc)
            self._ok = False
            return False
        self._answered(receipts[0], replace, renewal=not held and not dropped and not replace)
        return True

    def _answered(self, receipt: L2Receipt, replace: bool, renewal: bool) -> None:
        self._last_sent = self._clock()
        self.reports += 1
        self.renewals += renewal
        if not self._ok:
            log.info("L2 holder %s: the namespace directory takes its reports again",
                     self.holder)
        self._ok = True
        if receipt.standing is L2Standing.UNLISTED and not replace:
            log.info("L2 holder %s: the namespace directory had dropped its listing; the next "
                     "report lists all of its pages", self.holder)
            with self._lock:
                self._replace = True
        elif receipt.standing is L2Standing.RETIRED and not self._retired:
            self._retired = True
            log.warning("L2 holder %s: a newer start of the same name replaced incarnation %s "
                        "in the namespace directory; its reports are ignored", self.holder,
                        self.incarnation)
