"""What vLLM's KvtierConnector needs from Ray: the cluster, the L3 namespace actor, its page
directory and each worker's client of the namespace's storage (docs/vllm.md).

The connector runs in vLLM's processes (EngineCore for the scheduler side, one process per
worker), which join the Ray cluster that holds the namespace actor here, as `kvtier serve
--address` joins one. Every directory call is bounded and never raises: a directory that does
not answer is an L3 miss, a report that does not reach it a page left unpublished.
"""
from __future__ import annotations

import logging
import os
from typing import Callable, Sequence, TypeVar

import ray

from kvtier.actors.l3.contact_keeper import ContactKeeper
from kvtier.actors.l3.l2_reporter import L2Reporter
from kvtier.actors.l3.namespace_actor import ACTOR_NAME, get_or_create_namespace_actor
from kvtier.actors.l3.rank_link import directory_client, open_namespace_backend
from kvtier.actors.ray_join import join_cluster
from kvtier.backends.base import StorageBackend
from kvtier.errors import ConfigError, UnknownNamespaceError
from kvtier.kv_spec import HeadRange
from kvtier.messages import (L2Receipt, LookupResult, NamespaceInfo, NamespaceSpec, PeerContact,
                             PeerOffer, PeerRank)
from kvtier.tiers.storage_tier import DIRECTORY_LEASE_S
from kvtier.tiers.storage_types import PageDirectoryClient

log = logging.getLogger(__name__)
T = TypeVar("T")
RAY_ADDRESS_ENV = "RAY_ADDRESS"  # read by join when ray_address is not given


def join(address: str | None) -> None:
    """This process on the Ray cluster of the L3 namespace actor: the one it is on already,
    else `address` (ray_address in kv_connector_extra_config), else $RAY_ADDRESS (Ray Serve
    and Ray jobs hand it to the processes they start, vLLM's included). Where no Ray answers,
    a ClusterJoinError within GCS_PROBE_TIMEOUT_S (actors/ray_join.py)."""
    if ray.is_initialized():
        return
    address = address or os.environ.get(RAY_ADDRESS_ENV)
    if not address:
        raise ConfigError("KvtierConnector: an L3 storage backend and peers need the Ray "
                          "cluster of the L3 namespace actor: set ray_address in "
                          "kv_connector_extra_config (e.g. '127.0.0.1:6379' after `ray start "
                          f"--head`), or {RAY_ADDRESS_ENV} in the environment of vLLM's "
                          "processes")
    join_cluster(address)


def register_namespace(address: str | None, spec: NamespaceSpec, actor: str | None = None,
                       state_dir: str | None = None) -> NamespaceInfo:
    """The namespace `spec` registered with the cluster's namespace actor `actor` (default
    kvtier's; created when none runs, keeping its registry in `state_dir`; registering is
    idempotent, so every vLLM process may do it)."""
    join(address)
    return get_or_create_namespace_actor(actor or ACTOR_NAME, state_dir).register(spec)


class RegisteredDirectory:
    """The namespace actor's directory of one namespace as the connector calls it: when the
    actor does not know the namespace (it restarted without its state), the namespace's
    `spec` is registered again (idempotent: every process of every engine may) and the call
    made once more, as kvtier's own ranks do (rank_link.RankL3Link). Without it an engine
    would miss L3 and its peers until another engine registered the namespace."""

    def __init__(self, client: PageDirectoryClient, spec: NamespaceSpec) -> None:
        self._client, self.spec = client, spec

    def _again(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except UnknownNamespaceError:
            log.warning("the L3 namespace actor does not know namespace %s (it restarted "
                        "without its state); registering it again", self.spec.namespace)
            self._client.register(self.spec)
            return call()

    def lookup(self, ns: str, hashes: Sequence[str], lease_ttl_s: float = 0.0) -> LookupResult:
        return self._again(lambda: self._client.lookup(ns, hashes, lease_ttl_s))

    def release(self, lease_id: str) -> bool:
        return self._client.release(lease_id)  # a lease dies with the state that granted it

    def report_missing(self, ns: str, hashes: Sequence[str]) -> int:
        return self._again(lambda: self._client.report_missing(ns, hashes))

    def report_stored(self, ns: str, hashes: Sequence[str], heads: HeadRange) -> list[str]:
        return self._again(lambda: self._client.report_stored(ns, hashes, heads))

    def best_peer(self, ns: str, hashes: Sequence[str], asker: str) -> PeerOffer:
        return self._again(lambda: self._client.best_peer(ns, hashes, asker))

    def report_l2(self, ns: str, holder: str, incarnation: str, held: Sequence[str],
                  dropped: Sequence[str] = (), replace: bool = False) -> L2Receipt:
        return self._again(lambda: self._client.report_l2(ns, holder, incarnation, held,
                                                          dropped, replace))

    def forget_l2(self, holder: str, incarnation: str) -> int:
        return self._client.forget_l2(holder, incarnation)

    def register_peer(self, ns: str, holder: str, incarnation: str, rank: PeerRank) -> None:
        self._again(lambda: self._client.register_peer(ns, holder, incarnation, rank))


class DirectoryLink:
    """The scheduler side's view of one namespace's page directory (the connector's
    L3Directory and PeerDirectory), as L2 holder `holder` in its start `incarnation`
    (tiers/l2_holders.py: the engine's workers register their contacts under the same)."""

    def __init__(self, address: str | None, info: NamespaceInfo, actor: str | None = None,
                 holder: str = "", incarnation: str = "") -> None:
        join(address)
        self.namespace, self.holder, self.incarnation = info.namespace, holder, incarnation
        self._client = RegisteredDirectory(directory_client(actor or ACTOR_NAME), info.spec)

    def best_peer(self, keys: Sequence[str]) -> tuple[int, PeerContact | None]:
        try:
            offer = self._client.best_peer(self.namespace, list(keys), self.holder)
        except Exception as exc:  # noqa: BLE001 - any directory failure is a peer miss
            log.warning("peer lookup failed (%s: %s); a miss", type(exc).__name__, exc)
            return 0, None
        return max(0, min(int(offer.pages), len(keys))), offer.contact

    def lookup(self, keys: Sequence[str]) -> tuple[int, str]:
        try:
            found = self._client.lookup(self.namespace, list(keys), DIRECTORY_LEASE_S)
            hit, lease = int(found.hit_pages), str(found.lease_id or "")
        except Exception as exc:  # noqa: BLE001 - any directory failure is an L3 miss
            log.warning("L3 lookup failed (%s: %s); a miss", type(exc).__name__, exc)
            return 0, ""
        return (hit, lease) if 0 <= hit <= len(keys) else (0, lease)

    def release(self, lease_id: str) -> None:
        try:
            self._client.release(lease_id)
        except Exception as exc:  # noqa: BLE001 - an unreleased lease expires by itself
            log.warning("releasing an L3 lease failed (%s); it expires", exc)

    def report_missing(self, keys: Sequence[str]) -> None:
        try:
            self._client.report_missing(self.namespace, list(keys))
        except Exception as exc:  # noqa: BLE001 - the next reader reports them again
            log.warning("reporting %d unreadable L3 pages failed (%s)", len(keys), exc)

    def l2_reporter(self) -> L2Reporter:
        """What tells the directory the engine's L2 pages, under its holder name and
        incarnation, and renews its lease."""
        return L2Reporter(self._client, self.namespace, self.holder, self.incarnation)


def register_peer(address: str | None, info: NamespaceInfo, holder: str, incarnation: str,
                  rank: PeerRank, actor: str | None = None) -> ContactKeeper:
    """Tell the namespace's directory how peers reach TP rank `rank.rank` of L2 holder
    `holder`'s start `incarnation` (a worker, once its pool and table are registered on its
    endpoint), and again on an interval until the keeper returned is closed. Raises when
    the directory does not answer the first time: an engine that cannot lend is
    misconfigured."""
    join(address)
    return ContactKeeper(RegisteredDirectory(directory_client(actor or ACTOR_NAME), info.spec),
                         info.namespace, holder, incarnation, rank)


class WorkerStorage:
    """One worker's L3: its client of the namespace's storage (its own KV heads) and its
    reports of what it stored to the directory."""

    def __init__(self, address: str | None, info: NamespaceInfo, heads: HeadRange,
                 actor: str | None = None) -> None:
        join(address)
        self.info, self.heads = info, heads
        self.backend: StorageBackend = open_namespace_backend(info, heads)
        self._client = RegisteredDirectory(directory_client(actor or ACTOR_NAME), info.spec)

    def report_stored(self, keys: Sequence[str]) -> None:
        """A page is published once every head's objects were reported, by any ranks."""
        try:
            self._client.report_stored(self.info.namespace, list(keys), self.heads)
        except Exception as exc:  # noqa: BLE001 - the page stays unpublished: a later miss
            log.warning("reporting %d stored L3 pages failed (%s); they stay unpublished",
                        len(keys), exc)

    def close(self) -> None:
        self.backend.close()
