"""The L3 namespace actor (one per cluster, named and detached) and the clients that call it.

Every Ray call for it lives here: `get_or_create_namespace_actor` creates or finds the actor,
`NamespaceClient` does each `.remote()` + bounded `ray.get`, and `FakeNamespaceClient` has
the same methods over a local `NamespaceService`, for tests of code that uses the client
without Ray. Arguments and results cross the boundary as msgpack records (kvtier.messages)
or plain str/int/list; page bytes never do: ranks move them with their own backend clients.

The actor: name "kvtier-l3" in Ray namespace "kvtier", lifetime detached, restarted without
limit (`max_restarts=-1`); a restart re-registers the namespaces persisted under its
`state_dir` and rebuilds their directories (see namespace_service). It asks for no CPU
(`num_cpus=0`): it is mostly idle and must never wait behind rank actors for a slot.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from kvtier.actors.l3.hosts import cluster_master_host, cluster_replica_num
from kvtier.actors.l3.namespace_service import NamespaceService
from kvtier.backends.base import StorageUnavailable
from kvtier.kv_spec import HeadRange
from kvtier.errors import PinRoomError
from kvtier.messages import (DirectoryStats, L2Forget, L2Holding, L2Listing, L2Receipt,
                             L2Report, LeaseGrant, LookupRequest, LookupResult, MissingReport,
                             NamespaceInfo, NamespaceSpec, PeerOffer, PeerQuery, PeerRank,
                             PeerRegistration, PinGrant, PinRequest, StoredReport,
                             unpack_records)
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.page_pins import L3PinListing

log = logging.getLogger(__name__)

ACTOR_NAME = "kvtier-l3"
RAY_NAMESPACE = "kvtier"
CALL_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 60.0
_RETRY_S = 0.2
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 0.5, 5.0


class NamespaceUnavailable(StorageUnavailable):
    """The namespace actor did not answer in time (down, restarting): treat L3 as a miss."""


def default_state_dir(name: str = ACTOR_NAME) -> str:
    return os.path.join(tempfile.gettempdir(), f"kvtier-l3-state-{name}")


class _Client:
    """The typed methods; subclasses say how one call reaches the service."""

    def _call(self, method: str, *args: Any) -> Any:
        raise NotImplementedError

    def register(self, spec: NamespaceSpec) -> NamespaceInfo:
        """Register a namespace (idempotent); ranks open their backends from the result."""
        return NamespaceInfo.from_msgpack(self._call("register", spec.to_msgpack()))

    def info(self, ns: str) -> NamespaceInfo:
        return NamespaceInfo.from_msgpack(self._call("info", ns))

    def namespaces(self) -> list[str]:
        return list(self._call("namespaces"))

    def report_stored(self, ns: str, hashes: Sequence[str], heads: HeadRange) -> list[str]:
        """This rank stored the objects of KV heads `heads` of `hashes`; returns the pages now
        published (every head stored)."""
        report = StoredReport(ns, heads.start, heads.stop, tuple(hashes))
        return list(self._call("report_stored", report.to_msgpack()))

    def report_missing(self, ns: str, hashes: Sequence[str]) -> int:
        """A read found these published pages missing or corrupt; returns how many the
        directory unpublished."""
        return int(self._call("report_missing", MissingReport(ns, tuple(hashes)).to_msgpack()))

    def lookup(self, ns: str, hashes: Sequence[str], lease_ttl_s: float = 0.0) -> LookupResult:
        req = LookupRequest(ns, tuple(hashes), float(lease_ttl_s))
        return LookupResult.from_msgpack(self._call("lookup", req.to_msgpack()))

    def lease(self, ns: str, hashes: Sequence[str], ttl_s: float) -> LeaseGrant:
        req = LookupRequest(ns, tuple(hashes), float(ttl_s))
        return LeaseGrant.from_msgpack(self._call("lease", req.to_msgpack()))

    def release(self, lease_id: str) -> bool:
        return bool(self._call("release", lease_id))

    def report_l2(self, ns: str, holder: str, incarnation: str, held: Sequence[str],
                  dropped: Sequence[str] = (), replace: bool = False) -> L2Receipt:
        """`holder` (an instance; `incarnation`: this start of it) gained `held` and lost
        `dropped` in its L2 (`replace`: held is all it holds now; nothing: a renewal of its
        lease); the pages it lists now and how the report was taken."""
        report = L2Report(ns, holder, incarnation, tuple(held), tuple(dropped), replace)
        return L2Receipt.from_msgpack(self._call("report_l2", report.to_msgpack()))

    def forget_l2(self, holder: str, incarnation: str) -> int:
        """`holder`'s `incarnation` stopped: the pages it listed in L2 are forgotten (how
        many; none when a newer incarnation holds the name)."""
        return int(self._call("forget_l2", L2Forget(holder, incarnation).to_msgpack()))

    def l2_holders(self, ns: str, hashes: Sequence[str]) -> tuple[L2Holding, ...]:
        """Who holds a leading run of `hashes` in L2, the longest run first."""
        request = LookupRequest(ns, tuple(hashes))
        return L2Listing.from_msgpack(self._call("l2_holders", request.to_msgpack())).holders

    def register_peer(self, ns: str, holder: str, incarnation: str, rank: PeerRank) -> None:
        """`holder`'s TP rank `rank` lends its L2 pages of `ns` to peers, reached as it says
        (again: a renewal of the holder's lease)."""
        self._call("register_peer",
                   PeerRegistration(ns, holder, incarnation, rank).to_msgpack())

    def best_peer(self, ns: str, hashes: Sequence[str], asker: str) -> PeerOffer:
        """The peer other than `asker` holding the longest leading run of `hashes` in L2,
        with its contact (0 pages: none)."""
        query = PeerQuery(ns, asker, tuple(hashes))
        return PeerOffer.from_msgpack(self._call("best_peer", query.to_msgpack()))

    def rebuild(self, ns: str) -> int:
        return int(self._call("rebuild", ns))

    def stats(self, ns: str) -> DirectoryStats:
        return DirectoryStats.from_msgpack(self._call("stats", ns))

    def purge(self, ns: str) -> int:
        """Empty namespace `ns` on purpose (every page deleted from its storage, the directory
        reset, a new epoch: ranks back their pages up again); returns the pages deleted."""
        return int(self._call("purge", ns))

    def pin(self, ns: str, pin_id: str, hashes: Sequence[str], ttl_s: float,
            max_fraction: float, tenant: str = "") -> int:
        """Pin the leading published pages of `hashes` (page_pins); the pages pinned, or
        PinRoomError with the room missing."""
        grant = PinGrant.from_msgpack(self._call("pin", PinRequest(
            ns, pin_id, tuple(hashes), float(ttl_s), float(max_fraction), tenant).to_msgpack()))
        if grant.refusal:
            raise PinRoomError(grant.needed_pages, grant.free_pages, f"the L3 namespace {ns}")
        return grant.pages

    def unpin(self, ns: str, pin_id: str) -> bool:
        return bool(self._call("unpin", ns, pin_id))

    def refresh_pins(self, ns: str, pin_ids: Sequence[str]) -> int:
        """Hits in an instance's L2 extend these pins in L3 too."""
        return int(self._call("refresh_pins", ns, list(pin_ids)))

    def pins(self, ns: str) -> list[L3PinListing]:
        return unpack_records(L3PinListing, self._call("pins", ns))

    def masters(self) -> dict[str, int]:
        """The pid of each Mooncake master the actor runs, by namespace (on its node)."""
        return {str(ns): int(pid) for ns, pid in self._call("masters").items()}

    def ping(self) -> str:
        """The service's incarnation id: it changes when the actor restarts."""
        return str(self._call("ping"))


class NamespaceClient(_Client):
    """A handle on the namespace actor; every call waits at most `timeout_s`.

    Picklable (it holds an actor handle), so it can be passed to rank actors.
    """

    def __init__(self, handle: Any, timeout_s: float = CALL_TIMEOUT_S) -> None:
        self.handle = handle
        self.timeout_s = timeout_s
        self._backoff_s = 0.0
        self._down_until = 0.0  # monotonic time before which calls fail without trying
        self._probe: Any = None  # a ping sent after a failure: its answer says the actor is back

    def __getstate__(self) -> dict:
        return {"handle": self.handle, "timeout_s": self.timeout_s}  # no back-off state

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["handle"], state["timeout_s"])

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One bounded call. After a failure calls fail at once, without waiting, until the
        actor answers the ping sent then (the probe), or if that ping failed too, for a
        back-off (0.5 s, doubling to 5 s) before a call tries again: while the actor
        restarts, a rank's every lookup, report and check would otherwise wait out the
        timeout in the middle of a scheduling step, and steps that slow make the router
        hold the instance stalled. One outage costs a client one timeout."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        if not ray.is_initialized():  # a call would quietly start a new local cluster
            raise NamespaceUnavailable(f"Ray is not running in this process; cannot call the L3 "
                                       f"namespace actor's {method}: connect to the cluster first")
        why = self._down_why() if method != "ping" else None
        if why is not None:
            raise NamespaceUnavailable(f"the L3 namespace actor {why}; not calling {method} "
                                       "(L3 misses)")
        try:
            result = ray.get(getattr(self.handle, method).remote(*args), timeout=timeout_s)
        except GetTimeoutError as exc:
            self._failed()
            raise NamespaceUnavailable(
                f"the L3 namespace actor did not answer {method} within {timeout_s:.1f} s; "
                "treat L3 as a miss and retry later (is the actor restarting?)") from exc
        except RayActorError as exc:
            self._failed()
            raise NamespaceUnavailable(
                f"the L3 namespace actor failed during {method} ({type(exc).__name__}); it is "
                "restarted automatically: treat L3 as a miss and retry") from exc
        self._answered()
        return result

    def _failed(self) -> None:
        self._backoff_s = min(max(2 * self._backoff_s, _BACKOFF_MIN_S), _BACKOFF_MAX_S)
        self._down_until = time.monotonic() + self._backoff_s
        self._probe = self.handle.ping.remote()  # queued while the actor restarts

    def _answered(self) -> None:
        """The actor answered: calls go through again."""
        self._backoff_s, self._down_until, self._probe = 0.0, 0.0, None

    def _down_why(self) -> str | None:
        """Why calls fail at once now, or None: call (`_call`)."""
        if self._probe is not None:
            ready, _ = ray.wait([self._probe], timeout=0)
            if not ready:
                return "has not answered since a call failed"
            probe, self._probe = self._probe, None
            try:
                ray.get(probe, timeout=0)
            except Exception:  # noqa: BLE001 - the ping failed too: back off, then call
                pass
            else:
                self._answered()
                return None
        left = self._down_until - time.monotonic()
        if left > 0:
            return f"failed a call recently (trying again in {left:.1f} s)"
        return None

    def kill(self) -> None:
        """Kill the actor's process (fault injection); Ray restarts it, and it rebuilds its
        directories from the backends."""
        ray.kill(self.handle, no_restart=False)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> str:
        """Ping until the actor answers (after creation or a restart); its incarnation id."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                return str(self._call("ping", timeout_s=max(0.1, min(left, self.timeout_s))))
            except NamespaceUnavailable:
                if time.monotonic() + _RETRY_S >= deadline:
                    raise
                time.sleep(_RETRY_S)

    def shutdown(self, timeout_s: float = CALL_TIMEOUT_S) -> None:
        """Stop the actor for good: close its clients and masters, then kill it (no restart).
        Its persisted namespaces stay in its state_dir for a later actor."""
        try:
            self._call("close", timeout_s=timeout_s)
        except NamespaceUnavailable as exc:
            log.warning("namespace actor did not close cleanly (%s); killing it", exc)
        if ray.is_initialized():
            ray.kill(self.handle, no_restart=True)


def purge_namespace(actor: str, ns: str, timeout_s: float = CALL_TIMEOUT_S) -> int:
    """Empty namespace `ns` of the running namespace actor `actor` (POST /admin/purge): its
    pages are deleted from storage and its directory starts over under a new epoch, which
    the ranks follow (they forget what they believed was in L3 and back pages up again).
    Returns the pages deleted; NamespaceUnavailable when no such actor runs."""
    try:
        handle = ray.get_actor(actor, namespace=RAY_NAMESPACE)
    except ValueError:
        raise NamespaceUnavailable(f"no L3 namespace actor {actor!r} is running; attach L3 "
                                   "first (POST /admin/storage/attach)") from None
    return NamespaceClient(handle, timeout_s).purge(ns)


def get_or_create_namespace_actor(name: str = ACTOR_NAME, state_dir: str | None = None, *,
                                  timeout_s: float = CALL_TIMEOUT_S,
                                  ready_timeout_s: float = READY_TIMEOUT_S,
                                  resources: dict[str, float] | None = None) -> NamespaceClient:
    """The cluster's namespace actor `name`, created if it does not exist yet (race-free).

    `state_dir` (default: a directory under the system temp dir named after the actor) must
    be on the node where the actor runs; an existing actor keeps the one it was created with.
    `resources` (e.g. `{"kvtier_head": 1}`, offered only by the head node in cluster.yaml) pins
    a newly created actor to the nodes that offer them. Mooncake masters it starts bind as
    actors/l3/hosts decides (the node's address when ranks can span hosts), and so does the
    number of copies of each Mooncake object (2 when they span hosts).
    """
    remote_cls = ray.remote(NamespaceService)
    handle = remote_cls.options(
        name=name, namespace=RAY_NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_task_retries=0, num_cpus=0, resources=resources or {},
    ).remote(state_dir or default_state_dir(name), master_host=cluster_master_host,
             replica_num=cluster_replica_num)
    client = NamespaceClient(handle, timeout_s)
    client.wait_ready(ready_timeout_s)
    return client


class FakeNamespaceClient(_Client):
    """The client's interface over an in-process service (no Ray): same records, same bytes.

    With `sync_passes` (the default) every call is followed by an eviction pass in the
    calling thread (after any pass already running), so tests see quota evictions and their
    deletes done when a call returns; without it they happen on the service's background
    thread only, as in the actor."""

    sync_passes = True  # a class default: subclasses that build their own service keep it

    def __init__(self, state_dir: str | None = None,
                 directory: PageDirectory | None = None, sync_passes: bool = True) -> None:
        self.service = NamespaceService(state_dir, directory)
        self.sync_passes = sync_passes

    def _call(self, method: str, *args: Any) -> Any:
        result = getattr(self.service, method)(*args)
        if self.sync_passes and method != "close":
            self.service.run_pass()
        return result

    def shutdown(self) -> None:
        self.service.close()

    close = shutdown

    def __enter__(self) -> "FakeNamespaceClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
