"""The faults of `kvtier bench chaos`, injected into a serve graph running on this machine's
local Ray cluster, and the ranks' leak audit once its traffic has stopped: every Ray call of
the chaos bench.

- `kill_rank`: one rank actor of one instance killed at once, in the middle of a step or not
  (the deployment's replica kills it: ServedReplica.kill_rank). The instance notices at its
  next call, replaces its ranks and recomputes what it has not answered (actors/instance.py).
- `kill_namespace`: the L3 namespace actor's process killed; Ray restarts it and the new
  incarnation restores its namespaces from its state directory (actors/l3/namespace_service.py).
  With `lose_state` that directory is deleted first: the new incarnation knows no namespace.
- `restart_mooncake_master`: a namespace's Mooncake master killed (SIGKILL); the actor's
  supervisor starts a new one on new ports under a new epoch.
- `audit`: every rank's audit (Rank.audit: it waits for its copies to settle first);
  `deployment_states`: whether Serve holds each instance's deployment healthy.

Masters are processes of the namespace actor, not Ray actors: one whose actor was killed with
its state lost is known to nobody, so `close()` stops every master seen here that still runs
(its command line checked first: a pid may have been reused).
"""
from __future__ import annotations

import enum
import logging
import os
import shutil
import signal
from typing import NamedTuple

import ray

from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE, NamespaceClient, NamespaceUnavailable
from kvtier.actors.pd.deployment import PD_NAME, member_names
from kvtier.actors.serve_graph import APP_NAME, instance_names
from kvtier.errors import KvtierError
from kvtier.frontend.settings import ServeSettings
from kvtier.messages import unpack_record
from kvtier.tiers.cache_types import CacheAudit

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 60.0
MASTER_BINARY = b"mooncake_master"


class Role(enum.Enum):
    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


class RankTarget(NamedTuple):
    """One instance of the graph, as a fault names it."""

    deployment: str  # the Serve deployment whose replica drives it
    member: int  # its index among that deployment's instances
    name: str  # instance-0, prefill-0, decode-0 ...
    role: Role


class RankAudit(NamedTuple):
    """The audits of every rank of every instance, summed (the actor soak's leak figures)."""

    ranks: int
    leaked_pages: int  # L1 and L2 pages no tree node holds, orphaned L2 pages
    leaked_locks: int  # nodes still locked or protected
    open_tickets: int  # L3 reads or writes still open
    by_instance: dict[str, list[CacheAudit]]  # each rank's audit, by instance name

    @classmethod
    def of(cls, by_instance: dict[str, list[CacheAudit]]) -> "RankAudit":
        audits = [a for ranks in by_instance.values() for a in ranks]
        return cls(len(audits),
                   sum(a.leaked_pages + a.orphaned_host_pages for a in audits),
                   sum(a.locked_nodes + a.protected_nodes for a in audits),
                   sum(a.open_prefetches for a in audits), by_instance)

    @property
    def clean(self) -> bool:
        return self.leaked_pages == 0 and self.leaked_locks == 0


def rank_targets(settings: ServeSettings) -> list[RankTarget]:
    """Every instance of the graph `settings` deploys, in the deployments' member order."""
    if settings.pd:
        return [RankTarget(PD_NAME, i, name,
                           Role.PREFILL if i < settings.prefill_instances else Role.DECODE)
                for i, name in enumerate(member_names(settings))]
    return [RankTarget(name, 0, name, Role.MIXED) for name in instance_names(settings)]


class ChaosFaults:
    """Faults into the graph of `settings` (deployed as app `serve_graph.APP_NAME` by this
    process's Ray driver), and its ranks' audit."""

    def __init__(self, settings: ServeSettings, call_timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.settings, self.call_timeout_s = settings, call_timeout_s
        self._masters: dict[int, bytes] = {}  # pid -> command line, every master seen

    def _handle(self, deployment: str):
        from ray import serve

        _check_connected()
        return serve.get_deployment_handle(deployment, app_name=APP_NAME)

    def kill_rank(self, target: RankTarget, rank: int) -> bool:
        """Kill rank `rank` of `target` now; False when its ranks were being replaced."""
        call = self._handle(target.deployment).kill_rank.remote(target.member, rank)
        return bool(call.result(timeout_s=self.call_timeout_s))

    def _namespace(self) -> NamespaceClient | None:
        _check_connected()
        try:
            handle = ray.get_actor(self.settings.l3_actor, namespace=RAY_NAMESPACE)
        except ValueError:  # no L3, or no instance attached it yet
            return None
        return NamespaceClient(handle)

    def kill_namespace(self, lose_state: bool = False) -> bool:
        """Kill the namespace actor (Ray restarts it); with `lose_state` its state directory
        is deleted first. False when there is no such actor."""
        client = self._namespace()
        if client is None:
            return False
        self._note_masters(client)
        if lose_state:
            if not self.settings.l3_state_dir:
                return False  # nothing to lose: the bench always names one
            shutil.rmtree(self.settings.l3_state_dir, ignore_errors=True)
        client.kill()
        return True

    def restart_mooncake_master(self) -> bool:
        """Kill one Mooncake master the namespace actor runs (its supervisor starts another);
        False when it runs none (no Mooncake L3, or it is restarting)."""
        client = self._namespace()
        pids = self._note_masters(client) if client is not None else []
        return any(_kill_master(pid, self._masters[pid]) for pid in pids[:1])

    def _note_masters(self, client: NamespaceClient) -> list[int]:
        """The pids of the masters the actor runs now, remembered for `close`."""
        try:
            pids = sorted(client.masters().values())
        except NamespaceUnavailable as exc:
            log.info("the namespace actor cannot list its masters now: %s", exc)
            return []
        for pid in pids:
            cmdline = _cmdline(pid)
            if cmdline is not None:
                self._masters.setdefault(pid, cmdline)
        return [pid for pid in pids if pid in self._masters]

    def deployment_states(self) -> dict[str, str]:
        """Each instance deployment's state as Serve's controller has it ("HEALTHY", or the
        state, why, and its message: a replica that failed its health check is replaced)."""
        from ray import serve

        _check_connected()
        app = serve.status().applications.get(APP_NAME)
        out: dict[str, str] = {}
        for name in dict.fromkeys(t.deployment for t in rank_targets(self.settings)):
            d = app.deployments.get(name) if app is not None else None
            if d is None:
                out[name] = "MISSING"
            elif d.status.value == "HEALTHY":
                out[name] = "HEALTHY"
            else:
                out[name] = f"{d.status.value} ({d.status_trigger.value}): {d.message}"[:500]
        return out

    def audit(self) -> RankAudit:
        """Every rank's audit, by instance (call once the traffic has stopped)."""
        by_deployment: dict[str, list[list[bytes]]] = {}
        by_instance: dict[str, list[CacheAudit]] = {}
        for target in rank_targets(self.settings):
            if target.deployment not in by_deployment:
                call = self._handle(target.deployment).audit.remote()
                by_deployment[target.deployment] = call.result(timeout_s=self.call_timeout_s)
            by_instance[target.name] = [unpack_record(CacheAudit, b) for b in
                                        by_deployment[target.deployment][target.member]]
        return RankAudit.of(by_instance)

    def close(self) -> None:
        """Stop the namespace actor (and the masters it runs), then every master seen here
        that still runs: one orphaned by a lost state would outlive the cluster. Call it
        before the cluster stops (a killed actor's masters would outlive it too)."""
        client = self._namespace()
        if client is not None:
            client.shutdown()
        for pid, cmdline in self._masters.items():
            if _kill_master(pid, cmdline):
                log.info("stopped the Mooncake master pid %d (left by a killed namespace actor)",
                         pid)
        self._masters.clear()


def _check_connected() -> None:
    """Serve's and Ray's calls would start a new local cluster in a process not connected to
    one: a fault or a look after the graph stopped must fail instead."""
    if not ray.is_initialized():
        raise NotConnected("Ray is not running in this process: the chaos graph has stopped")


class NotConnected(KvtierError, RuntimeError):
    """A chaos call after the cluster stopped."""


def _cmdline(pid: int) -> bytes | None:
    """The command line of `pid` when it is a Mooncake master, else None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read()
    except OSError:
        return None
    return cmdline if cmdline.split(b"\0")[0].endswith(MASTER_BINARY) else None


def _kill_master(pid: int, cmdline: bytes) -> bool:
    """SIGKILL `pid` if it still runs `cmdline` (a master seen before); whether it did."""
    if _cmdline(pid) != cmdline:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        return False
    return True
