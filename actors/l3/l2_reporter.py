"""An instance's L2 holdings, told to the L3 namespace directory off the caller's path.

Both kinds of instance feed one: kvtier's own through its instance server (rank 0's cache
events), vLLM engines through KvtierConnector's scheduler side (its L2 index's changes). The
caller only records what changed (`held`, `dropped`); a thread of the reporter's own sends
the net changes every `interval_s`, one call at a time, so reports reach the directory in
order and a slow or absent directory never delays a step.

The reporter keeps what the holder holds now, so a report that failed is made good by the
next one: it then replaces the holder's whole listing. The first report replaces too, which
clears what an earlier run of the same holder left behind. `close` tells the directory the
holder holds nothing any more.
"""
from __future__ import annotations

import logging
import threading
from typing import Iterable, Protocol, Sequence

from kvtier.messages import MAX_HASHES

log = logging.getLogger(__name__)

REPORT_INTERVAL_S = 0.2
MAX_BACKOFF_S = 5.0  # after failures the reporter waits up to this long between tries


class L2Directory(Protocol):
    """What the reporter calls: the namespace actor's clients and PageDirectory have it."""

    def report_l2(self, ns: str, holder: str, held: Sequence[str], dropped: Sequence[str] = (),
                  replace: bool = False) -> int: ...

    def forget_l2(self, holder: str) -> int: ...


class L2Reporter:
    """`holder`'s L2 changes of namespace `namespace`, sent to `directory` in the background."""

    def __init__(self, directory: L2Directory, namespace: str, holder: str,
                 interval_s: float = REPORT_INTERVAL_S) -> None:
        self.namespace, self.holder = namespace, holder
        self._directory = directory
        self._interval_s = interval_s
        self._lock = threading.Lock()  # guards what is held and changed
        self._sending = threading.Lock()
        self._holding: dict[str, None] = {}  # what the holder holds now, oldest first
        self._changes: dict[str, bool] = {}  # page -> held, since the last report sent
        self._replace = True  # the next report lists everything
        self._stop = threading.Event()
        self.reports = 0  # sent and answered
        self.failures = 0
        self._ok = True  # the last report reached the directory
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
        """Stop reporting; the directory forgets the holder's pages."""
        self._stop.set()
        self._thread.join(timeout_s)
        try:
            self._directory.forget_l2(self.holder)
        except Exception as exc:  # noqa: BLE001 - its listing stays until a restart replaces it
            log.warning("L2 holder %s: the directory did not forget its pages (%s)",
                        self.holder, exc)

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
                return True
            if replace:
                held, dropped = list(self._holding), []
            else:
                held = [p for p, now in self._changes.items() if now]
                dropped = [p for p, now in self._changes.items() if not now]
            self._changes.clear()
            self._replace = False
        try:
            first = True
            for start in range(0, max(len(held), len(dropped), 1), MAX_HASHES):
                self._directory.report_l2(self.namespace, self.holder,
                                          held[start:start + MAX_HASHES],
                                          dropped[start:start + MAX_HASHES],
                                          replace=replace and first)
                first = False
        except Exception as exc:  # noqa: BLE001 - the next report lists everything again
            self.failures += 1
            with self._lock:
                self._replace = True
            if self._ok:  # once per outage, not at every try
                log.warning("L2 holder %s: reporting to the namespace directory failed (%s); "
                            "the next report lists all of its pages", self.holder, exc)
            self._ok = False
            return False
        if not self._ok:
            log.info("L2 holder %s: the namespace directory takes its reports again",
                     self.holder)
        self._ok = True
        self.reports += 1
        return True
