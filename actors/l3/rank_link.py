"""A rank's link to its L3 namespace: build its cache keyed like a registered namespace, attach
its own client of the namespace's storage, follow the namespace when it moves or is purged.

`Rank` (actors/rank_actor) owns one `RankL3Link` and its remote `attach_l3`/`detach_l3`
delegate here. Pages move between the rank's L2 and the storage directly (its backend
client); the namespace actor's page directory only says which pages are published (the data
plane never goes through it).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Callable

import ray

from kvtier.actors.l3.hosts import node_address, node_label, rank_client_info
from kvtier.backends.base import StorageBackend, StorageUnavailable
from kvtier.errors import ConfigError, UnknownNamespaceError
from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceInfo
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.page_store import open_rank_backend
from kvtier.tiers.storage_types import PageDirectoryClient

if TYPE_CHECKING:
    from kvtier.actors.rank_actor import RankSettings

log = logging.getLogger(__name__)

# How often a rank asks the namespace actor whether its namespace moved to new storage (a
# Mooncake master restarted on new ports: a new epoch); one small call between steps.
L3_EPOCH_CHECK_S = 2.0
# A rank's directory calls run inside its scheduling steps, which the router's stall deadline
# (2 s by default) watches: the actor answers in about a millisecond, so a call that takes
# half a second is the actor restarting or gone, and an L3 miss is the right answer (a
# register cut short by it finishes in the actor and is seen at the next check). After one
# such call the client fails calls at once until the actor answers again (NamespaceClient).
# With 1 s, a PD deployment (a prefill and a decode instance in one step) stalled past the
# deadline when the actor was killed (kvtier bench chaos --pd).
RANK_CALL_TIMEOUT_S = 0.5


NO_STORAGE = "none"  # attach_l3's answer for the namespace's directory alone
BackendOpener = Callable[[NamespaceInfo, HeadRange], StorageBackend]
DirectoryOpener = Callable[[str], PageDirectoryClient]


class RankL3Link:
    """One rank's L3 namespace: the namespace attached and its actor, this rank's client of
    the actor's page directory, and when to ask about the namespace's epoch again. The cache
    it works on is passed to each call (the link exists before the rank's cache: it builds
    it)."""

    def __init__(self, rank: int, size: int, open_backend: BackendOpener,
                 open_directory: DirectoryOpener) -> None:
        """`open_backend(info, heads)`: this rank's client of a namespace's storage;
        `open_directory(l3_actor)`: its client of the namespace actor's page directory (the
        rank's hooks, which a test or soak subclass may wrap)."""
        self.rank, self.size = rank, size
        self._open_backend, self._open_directory = open_backend, open_directory
        self._l3: tuple[NamespaceInfo, str | None] | None = None  # the namespace attached
        self.directory: PageDirectoryClient | None = None  # its actor's, when it has one
        self._next_check = 0.0  # monotonic time of the next epoch check
        self.storage = True  # False: the namespace's directory alone (attach_l3)

    def build_cache(self, s: "RankSettings", spec, device) -> HierarchicalCache:
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
                                  tp_rank=self.rank, tp_size=self.size,
                                  deterministic=s.deterministic)
        self.storage = s.l3_storage
        try:
            self.attach(cache, info, s.l3_actor)
        except StorageUnavailable as exc:
            if self.directory is None:  # no actor to ask later
                cache.close()
                raise
            log.warning("rank %d: L3 namespace %s cannot be opened now (%s); L3 misses until "
                        "it can", self.rank, info.namespace, exc)
        except BaseException:
            cache.close()
            raise
        return cache

    def attach(self, cache: HierarchicalCache, info: NamespaceInfo,
               l3_actor: str | None, backend: StorageBackend | None = None) -> str:
        """Attach this rank's own client of namespace `info` (`backend`, or one opened now)
        as the L3 of `cache`, the namespace actor `l3_actor`'s directory gating hits; the
        backend's kind."""
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
        if cache.l3_attached:
            raise ConfigError("an L3 backend is attached already; detach it first")
        self._l3 = (info, l3_actor)  # what a re-attach after an epoch change starts from
        self.directory = None if l3_actor is None else self._open_directory(l3_actor)
        if not self.storage:  # the directory alone (peers; nothing read from or written to L3)
            if self.directory is None:
                raise ConfigError("L3 without its storage is the namespace actor's directory "
                                  "alone: give the actor's name")
            cache.attach_storage(None, self.directory, confirm_return=True)
            return NO_STORAGE
        if backend is None:
            backend = self._open_backend(info, cache.heads)
        try:
            # The actor may come back without the namespace or with other storage: stored
            # pages wait for `follow` to see it is the namespace attached (storage_tier).
            cache.attach_storage(backend, self.directory, confirm_return=l3_actor is not None)
        except BaseException:
            backend.close()
            raise
        return backend.kind.value

    def follow(self, cache: HierarchicalCache, force: bool = False) -> None:
        """Follow the namespace attached, between steps, at most every L3_EPOCH_CHECK_S
        (`force`: now). Never raises: an L3 metadata error is an L3 miss, counted in the
        storage's `directory_errors`, and the check runs again next time.

        - The namespace actor does not answer (down, restarting, timing out) or answers
          nonsense: the storage is away (L3 misses, stored pages unreported) until it does.
        - It answers that the namespace is unknown (it restarted without it: a failed
          restore, a corrupt state file, a Mooncake master that did not start): this rank
          registers the namespace's spec again. Registration is idempotent, so every rank of
          every instance may do it, whoever is first; the ranks are the ones that notice
          (they ask every few seconds) and each holds the spec it attached, so nothing else
          has to watch the actor. The directory rebuilds from the storage's listing.
        - The namespace is the one attached (same epoch, same storage): what waited is
          reported (`l3_directory_back`).
        - A new epoch on the same storage is a purge: the rank keeps its client, forgets what
          it believed was stored (and the reports that waited) and backs its L2 pages up
          again.
        - Other storage (a Mooncake master restarted on new ports, a new root marker): the
          rank opens a client of the new storage first and only then swaps it in; until that
          works it keeps the old one, away. Ranks of one instance may switch a few steps
          apart, which is safe: a rank that misses makes the agreed hit shorter, never wrong.
        """
        l3, directory = self._l3, self.directory
        if l3 is None or directory is None:
            return
        now = time.monotonic()
        if now < self._next_check and not force:
            return
        self._next_check = now + L3_EPOCH_CHECK_S
        info, l3_actor = l3
        try:
            if not cache.l3_attached:  # its storage could not be opened (an attach, or a swap
                # that failed half-way): again, as the actor knows the namespace now
                self.attach(cache, self._namespace_now(directory, info), l3_actor)
                return
            self._check_namespace(cache, directory, info, l3_actor)
        except Exception as exc:  # noqa: BLE001 - an L3 metadata error is a miss, not a failure
            if cache.l3_attached:
                cache.l3_directory_failed(f"following namespace {info.namespace}", exc)
            else:
                log.warning("rank %d: attaching L3 namespace %s failed (%s: %s); retrying in "
                            "%.0f s", self.rank, info.namespace, type(exc).__name__, exc,
                            L3_EPOCH_CHECK_S)

    def _check_namespace(self, cache: HierarchicalCache, directory: PageDirectoryClient,
                         info: NamespaceInfo, l3_actor: str | None) -> None:
        """One round of `follow` with the storage attached (may raise)."""
        current = self._namespace_now(directory, info)
        if same_storage(current, info):
            if current.epoch != info.epoch:  # the same storage, emptied on purpose: a purge
                log.warning("rank %d: L3 namespace %s was purged (epoch %d); backing up L2 "
                            "again", self.rank, info.namespace, current.epoch)
                self._l3 = (current, l3_actor)
                cache.storage_emptied()
            cache.l3_directory_back()
            return
        log.warning("rank %d: L3 namespace %s moved to new storage (epoch %d -> %d); "
                    "re-attaching", self.rank, info.namespace, info.epoch, current.epoch)
        if not self.storage:
            cache.detach_storage()
            self.attach(cache, current, l3_actor)
            return
        backend = self._open_backend(current, cache.heads)  # raises: the old one stays, away
        cache.detach_storage()
        self.attach(cache, current, l3_actor, backend)

    def _namespace_now(self, directory: PageDirectoryClient, info: NamespaceInfo
                       ) -> NamespaceInfo:
        """The namespace as the actor knows it now, registered again if it lost it."""
        try:
            return directory.info(info.namespace)
        except UnknownNamespaceError:
            log.warning("rank %d: the L3 namespace actor does not know namespace %s (it "
                        "restarted without it); registering it again", self.rank,
                        info.namespace)
            return directory.register(info.spec)

    def attach_l3(self, cache: HierarchicalCache, info: bytes, l3_actor: str | None,
                  storage: bool = True) -> str:
        """Attach the registered namespace `info` (a msgpack NamespaceInfo) as L3; its
        backend's kind. Storage that cannot be opened now (a Mooncake master restarting: a
        replacement rank must not fail its instance for it) is attached by `follow` once it
        can be, as the namespace actor knows it then; until then L3 misses. `storage` False:
        the namespace actor's directory alone, L3 off (`NO_STORAGE`): peers find each other's
        L2 pages through it (actors/l3/peer_link.py)."""
        got = NamespaceInfo.from_msgpack(info)
        self.storage = storage
        try:
            return self.attach(cache, got, l3_actor)
        except StorageUnavailable as exc:
            if self.directory is None:  # no actor to ask later: nothing to retry with
                raise
            log.warning("rank %d: L3 namespace %s cannot be opened now (%s); L3 misses until "
                        "it can (retried every %.0f s)", self.rank, got.namespace, exc,
                        L3_EPOCH_CHECK_S)
            self._next_check = time.monotonic() + L3_EPOCH_CHECK_S
            return got.spec.backend.value

    def detach(self, cache: HierarchicalCache) -> None:
        """Stop using L3 (queued backups finish first; nothing leaks)."""
        cache.detach_storage()
        self.directory = None
        self._l3 = None


def open_namespace_backend(info: NamespaceInfo, heads: HeadRange) -> StorageBackend:
    """A rank's client of the namespace's storage: a Mooncake client registers this node's
    address when the master is not on loopback; a file or nixl root must show the namespace
    actor's marker (actors/l3/hosts, shared_root)."""
    address = node_address()
    return open_rank_backend(rank_client_info(info, address), heads, node_label(address))


def same_storage(a: NamespaceInfo, b: NamespaceInfo) -> bool:
    """Do `a` and `b` name the same storage (whatever their epochs)? The same options (a
    restarted Mooncake master has a new address) and the same shared-root marker (a root
    that lost its marker is not the one the rank wrote to)."""
    return a.options == b.options and a.root_marker == b.root_marker


def directory_client(actor_name: str) -> PageDirectoryClient:
    """A client of the namespace actor `actor_name` (its page directory), found by name."""
    from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE, NamespaceClient
    try:
        handle = ray.get_actor(actor_name, namespace=RAY_NAMESPACE)
    except ValueError as exc:
        raise ConfigError(f"RankSettings.l3_actor: no L3 namespace actor named {actor_name!r} "
                          f"in Ray namespace {RAY_NAMESPACE!r} (create it with "
                          "get_or_create_namespace_actor), or set l3_actor=None") from exc
    return NamespaceClient(handle, RANK_CALL_TIMEOUT_S)
