"""Whether every instance stays in service during a chaos run: a thread that watches the
router (over HTTP: /admin/router) and Serve's view of the instance deployments (through
actors/chaos_faults.py) once a second, from the first request to the end of the audit.

An instance is lost when the router holds it broken (it gave up after its ranks kept
failing), when Serve holds its deployment anything but healthy (its replica failed a health
check and is being replaced), or when its rank-set epoch goes down (a new replica replaced it
between two looks). Restarts of its ranks, however many, are recoveries, not losses.

With `recover_within_s` (vLLM instances: a dead engine fails its replica's health check and
Serve starts a new replica, whose engine takes a minute or more to start) being out of service
(broken, unhealthy, or stalled: work waits and no step comes) is an outage, not yet a loss:
the instance is lost only when an outage lasts longer than that, or has not ended by the last
look; each outage that ended is a recovery (`recoveries`).
"""
from __future__ import annotations

import json
import logging
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Callable

from kvtier.bench.chaos_clients import error_cause

log = logging.getLogger(__name__)

INTERVAL_S = 1.0
HTTP_TIMEOUT_S = 10.0


def get_json(url: str, headers: dict | None = None,
             timeout_s: float = HTTP_TIMEOUT_S) -> tuple[int, Any]:
    """(HTTP status, decoded body); status 0 when nothing answered."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as exc:
        return exc.code, None
    except (urllib.error.URLError, OSError, ValueError):
        return 0, None


def router_status(base: str, admin_key: str) -> dict:
    status, body = get_json(f"{base}/admin/router", {"Authorization": f"Bearer {admin_key}"})
    return body if status == 200 and isinstance(body, dict) else {}


def idle(base: str, admin_key: str) -> bool:
    """Every instance has nothing queued or running (the router's latest poll)."""
    instances = router_status(base, admin_key).get("instances") or {}
    return bool(instances) and all(i.get("load") == 0 for i in instances.values())


class Monitor(threading.Thread):
    """`lost` (instance -> when and why, first seen), `epochs` (the highest rank-set epoch seen) and
    `stalls` (the router's count) of the graph at `base`, until `stop()`."""

    def __init__(self, base: str, admin_key: str,
                 deployment_states: Callable[[], dict[str, str]],
                 recover_within_s: float | None = None) -> None:
        super().__init__(name="kvtier-chaos-monitor", daemon=True)
        self.base, self.admin_key = base, admin_key
        self._states = deployment_states
        self.recover_within_s = recover_within_s
        self.start_s = time.monotonic()  # what `lost` times count from
        self.lost: dict[str, dict] = {}  # instance -> {"at_s", "why"}
        self.epochs: dict[str, int] = {}
        self.stalls: dict[str, int] = {}
        self.recoveries: dict[str, list[dict]] = {}  # instance -> outages that ended
        self._outages: dict[str, tuple[float, str]] = {}  # instance -> since (monotonic), why
        self._stop_event = threading.Event()
        self._lock = threading.Lock()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.look()
            self._stop_event.wait(INTERVAL_S)

    def stop(self) -> None:
        """Look a last time, then stop; an outage not ended by then is a loss."""
        self._stop_event.set()
        if self.ident is not None:  # started
            self.join(timeout=2 * HTTP_TIMEOUT_S)
        self.look()
        with self._lock:
            for name, (_, why) in self._outages.items():
                self._lose(name, f"out of service when the run ended: {why}")

    @property
    def all_up(self) -> bool:
        """No outage open at the last look (with `recover_within_s`)."""
        with self._lock:
            return not self._outages

    def look(self) -> None:
        with self._lock:
            down: dict[str, str] = {}
            answered = self._router(down)
            answered = self._serve(down) and answered
            if self.recover_within_s is not None and answered:
                self._follow_outages(down)

    def _down(self, down: dict[str, str], name: str, why: str) -> None:
        """`name` is out of service now: lost at once, or (`recover_within_s`) an outage."""
        if self.recover_within_s is None:
            self._lose(name, why)
        else:
            down.setdefault(name, why)

    def _follow_outages(self, down: dict[str, str]) -> None:
        now = time.monotonic()
        for name, why in down.items():
            since, first_why = self._outages.setdefault(name, (now, why))
            if now - since > self.recover_within_s:
                self._lose(name, f"out of service for over {self.recover_within_s:.0f} s: "
                                 f"{first_why}")
        for name in [n for n in self._outages if n not in down]:
            since, why = self._outages.pop(name)
            self.recoveries.setdefault(name, []).append(
                {"at_s": round(since - self.start_s, 1), "down_s": round(now - since, 1),
                 "why": error_cause(why, 200)})
            log.warning("chaos: instance %s back in service after %.1f s", name, now - since)

    def _lose(self, name: str, why: str) -> None:
        if name not in self.lost:
            at_s = round(time.monotonic() - self.start_s, 1)
            self.lost[name] = {"at_s": at_s, "why": error_cause(why)}
            log.warning("chaos: instance %s lost at %.1f s: %s", name, at_s,
                        self.lost[name]["why"])

    def _router(self, down: dict[str, str]) -> bool:
        """The router's view; whether it answered."""
        instances = router_status(self.base, self.admin_key).get("instances")
        for name, inst in (instances or {}).items():
            if inst.get("broken"):
                self._down(down, name, f"the router holds it broken: {inst['broken']}")
            elif inst.get("state") == "stalled" and self.recover_within_s is not None:
                self._down(down, name, "the router holds it stalled (work waits, no step)")
            epoch = inst.get("epoch")
            if isinstance(epoch, int):
                if epoch < self.epochs.get(name, 0):
                    self._down(down, name, f"its epoch went from {self.epochs[name]} to "
                                           f"{epoch}: a new replica replaced it")
                self.epochs[name] = max(epoch, self.epochs.get(name, 0))
            self.stalls[name] = int(inst.get("stalls") or 0)
        return bool(instances)

    def _serve(self, down: dict[str, str]) -> bool:
        """Serve's view; whether it answered."""
        try:
            states = self._states()
        except Exception as exc:  # noqa: BLE001 - Serve's controller busy: look again later
            log.info("chaos: Serve's deployment states are unavailable: %s", exc)
            return False
        for name, state in states.items():
            if state != "HEALTHY":
                self._down(down, name, f"Serve holds its deployment {state}")
        return True
