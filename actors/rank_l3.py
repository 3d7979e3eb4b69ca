"""The L3 calls of a rank actor: build its cache keyed like a registered namespace, attach its
own client of the namespace's storage, follow the namespace when it moves or is purged.

A base of `RankCache`, apart so the rank's module keeps to its noun. Pages move between the
rank's L2 and the storage directly (its backend client); the namespace actor's page directory
only says which pages are published (design: the data plane never goes through it).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import ray

from kvtier.actors.l3_hosts import node_address, node_label, rank_client_info
from kvtier.backends.base import StorageBackend, StorageUnavailable
from kvtier.errors import ConfigError
from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceInfo
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.page_store import open_rank_backend
from kvtier.tiers.storage_types import PageDirectoryClient

if TYPE_CHECKING:
    from kvtier.actors.rank_actor import RankSettings
    from kvtier.engine.engine import Engine

log = logging.getLogger(__name__)

# How often a rank asks the namespace actor whether its namespace moved to new storage (a
# Mooncake master restarted on new ports: a new epoch); one small call between steps.
L3_EPOCH_CHECK_S = 2.0


class RankL3:
    """The rank's L3 calls, over `self.engine.cache` (`_l3`: the namespace attached and its
    actor; `_l3_next_check`: when to ask about its epoch again)."""

    engine: "Engine"
    rank: int
    size: int
    _l3: "tuple[NamespaceInfo, str | None] | None" = None
    _l3_next_check: float = 0.0

    def _l3_cache(self, s: "RankSettings", spec, device) -> HierarchicalCache:
        """A cache keyed like the namespace `s.l3`, with this rank's own client of it as L3."""
        info = s.l3
        assert info is not None
        if s.config.storage_backend is not None:
            raise ConfigError("RankSettings: give either config.storage_backend or l3 (a "
                              "registered namespace), not both")
        # the L2 layout an attached L3 needs (page_head), whatever the settings' own layout
        config = s.config.normalize_for_l3(info.spec.backend)
        cache = HierarchicalCache(config, spec, s.device_pages, device=device,
                                  model=info.spec.model, tenant_salt=info.spec.tenant_salt,
                                  tp_rank=self.rank, tp_size=self.size)
        try:
            self._attach(cache, info, s.l3_actor)
        except BaseException:
            cache.close()
            raise
        return cache

    def _attach(self, cache: HierarchicalCache, info: NamespaceInfo,
                l3_actor: str | None) -> str:
        """Attach this rank's own client of namespace `info` as the L3 of `cache`, the
        namespace actor `l3_actor`'s directory gating hits; the backend's kind."""
        # Any TP size may use a namespace of the same model: objects name KV heads, not ranks.
        if info.spec.kv_heads != cache.heads.total:
            raise ConfigError(f"L3 namespace {info.namespace} is of a model with "
                              f"{info.spec.kv_heads} KV heads, this rank's model has "
                              f"{cache.heads.total}: register a namespace of this model "
                              f"(kv_heads={cache.heads.total}, describe())")
        if info.spec.key_namespace != cache.namespace:
            raise ConfigError(f"L3 namespace {info.namespace} keys pages as "
                              f"{info.spec.key_namespace} (layout fingerprint "
                              f"{info.spec.layout_fingerprint!r}), this rank as "
                              f"{cache.namespace}: register the namespace with the rank's "
                              f"model, tenant salt and layout fingerprint (describe())")
        if cache.storage is not None:
            raise ConfigError("an L3 backend is attached already; detach it first")
        self._l3 = (info, l3_actor)  # what a re-attach after an epoch change starts from
        cache.directory = None if l3_actor is None else self._directory(l3_actor)
        backend = self._open_backend(info, cache.heads)
        try:
            cache.attach_storage(backend)
        except BaseException:
            backend.close()
            raise
        return backend.kind.value

    def _open_backend(self, info: NamespaceInfo, heads: HeadRange) -> StorageBackend:
        """This rank's client of the namespace's storage (a subclass may wrap it): a Mooncake
        client registers this node's address when the master is not on loopback; a file or
        nixl root must show the namespace actor's marker (actors/l3_hosts, shared_root)."""
        address = node_address()
        return open_rank_backend(rank_client_info(info, address), heads, node_label(address))

    def _directory(self, l3_actor: str) -> PageDirectoryClient:
        """This rank's client of the namespace actor's page directory (a subclass may wrap
        it)."""
        return _directory_client(l3_actor)

    def _follow_l3(self) -> None:
        """Re-attach when the namespace moved to new storage: its Mooncake master restarted
        (new ports, an empty store, a new epoch) and this rank's client still talks to the
        old one, missing every read. Checked between steps, at most every
        L3_EPOCH_CHECK_S; ranks of one instance may switch a few steps apart, which is safe:
        a rank whose client misses makes the agreed hit shorter, never wrong. A new epoch on
        the same storage is a purge: the rank keeps its client, forgets what it believed was
        stored and backs its L2 pages up again."""
        cache = self.engine.cache
        l3 = self._l3
        if cache.storage is None or cache.directory is None or l3 is None:
            return
        now = time.monotonic()
        if now < self._l3_next_check:
            return
        self._l3_next_check = now + L3_EPOCH_CHECK_S
        info, l3_actor = l3
        try:
            current = cache.directory.info(info.namespace)
        except StorageUnavailable:
            return  # the actor is away: L3 misses meanwhile
        if current.epoch == info.epoch:
            return
        if current.options == info.options:  # the same storage, emptied on purpose: a purge
            log.warning("rank %d: L3 namespace %s was purged (epoch %d); backing up L2 again",
                        self.rank, info.namespace, current.epoch)
            self._l3 = (current, l3_actor)
            cache.storage_emptied()
            return
        log.warning("rank %d: L3 namespace %s moved to new storage (epoch %d -> %d); "
                    "re-attaching", self.rank, info.namespace, info.epoch, current.epoch)
        self.detach_l3()
        self._attach(cache, current, l3_actor)

    def attach_l3(self, info: bytes, l3_actor: str | None) -> str:
        """Attach the registered namespace `info` (a msgpack NamespaceInfo) as L3."""
        return self._attach(self.engine.cache, NamespaceInfo.from_msgpack(info), l3_actor)

    def detach_l3(self) -> None:
        """Stop using L3 (queued backups finish first; nothing leaks)."""
        cache = self.engine.cache
        cache.detach_storage()
        cache.directory = None


def _directory_client(actor_name: str):
    """A client of the namespace actor `actor_name` (its page directory), found by name."""
    from kvtier.actors.namespace_actor import RAY_NAMESPACE, NamespaceClient
    try:
        handle = ray.get_actor(actor_name, namespace=RAY_NAMESPACE)
    except ValueError as exc:
        raise ConfigError(f"RankSettings.l3_actor: no L3 namespace actor named {actor_name!r} "
                          f"in Ray namespace {RAY_NAMESPACE!r} (create it with "
                          "get_or_create_namespace_actor), or set l3_actor=None") from exc
    return NamespaceClient(handle)
