"""The L3 namespace's own client of a namespace's storage: delete whole pages, list pages.

Why one client owning every KV head: a backend names (and deletes) only the objects of its
own `StorageTarget` heads, and an evicted page must go whole (every part of every head), or
it stays a miss while the remaining parts keep using space. The admin client registers a tiny
placeholder pool so `delete` can name its objects; it never moves page bytes.

The client opens at attach when the namespace can need it (listable storage, or a quota), so
a namespace whose storage cannot be reached fails at registration with the backend's own
error; else at the first delete. (A Mooncake client listens on every interface for its
transfer engine: the actor opens none unless it must delete.) The admin client holds no data
and never evicts on its own: byte bounds are set to 0 (unbounded) and a Mooncake admin client
contributes no segment.

Rank clients (`open_rank_backend`) never evict on their own either: under a namespace the
directory is the one eviction authority (a process evicting by itself would delete every
rank's parts of pages the directory keeps advertising), so a backend's own bound in the
options is folded into the namespace's quota (`NamespaceSpec.capacity_pages`) and switched
off in the clients. A backend opened on its own, outside a namespace, keeps its own bound.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Protocol, Sequence

import torch

from kvtier.backends.base import KV_POOL, SWA_POOL, PagePart, StorageBackend, StorageTarget
from kvtier.backends.faulty import FaultyBackend
from kvtier.backends.registry import backend_class, create_backend
from kvtier.backends.shared_root import check_marker, shared_root_dir
from kvtier.errors import ConfigError
from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceInfo
from kvtier.policies import StorageBackendKind
from kvtier.storage_options import StorageOptions

log = logging.getLogger(__name__)

_PLACEHOLDER_PART_BYTES = 64
# Fields that would make a client of a namespace evict on its own (the directory's job).
_NO_OWN_EVICTION = {StorageBackendKind.FILE: {"max_size_bytes": 0},
                    StorageBackendKind.NIXL: {"max_size_bytes": 0},
                    StorageBackendKind.SIMULATED: {"capacity_pages": 0}}
# ... and, for admin clients, fields that would make them store anything of their own.
_ADMIN_OVERRIDES = {**_NO_OWN_EVICTION,
                    StorageBackendKind.MOONCAKE: {"global_segment_size_bytes": 0,
                                                  "local_buffer_size_bytes": 0}}


class PageStore(Protocol):
    """What the page directory needs from a namespace's storage (tests pass fakes)."""

    listable: bool

    def delete(self, hashes: Sequence[str]) -> int: ...

    def list_pages(self) -> dict[str, set[int]]: ...

    def reclaim_old_format(self) -> int: ...

    def close(self) -> None: ...


def rank_target(info: NamespaceInfo, heads: HeadRange | None = None) -> StorageTarget:
    """The storage target of one rank of a namespace's users: the KV heads it owns (None:
    all of them, a TP=1 rank)."""
    heads = HeadRange.all_of(info.spec.kv_heads) if heads is None else heads
    if heads.total != info.spec.kv_heads:
        raise ConfigError(f"L3 namespace {info.namespace} is of a model with "
                          f"{info.spec.kv_heads} KV heads, this rank's model has {heads.total}: "
                          "register a namespace of the rank's own model")
    return StorageTarget(info.spec.key_namespace, heads)


def open_rank_backend(info: NamespaceInfo, heads: HeadRange | None = None,
                      node: str | None = None) -> StorageBackend:
    """The backend client a rank uses for a namespace (pages move rank <-> storage directly),
    with the backend's own eviction off: the namespace's directory evicts (module docstring).

    A file or nixl root is first checked to be the one the namespace actor sees (its marker
    read back; RootNotShared naming `node`, default this host's name, when it is not). A
    `fault_file` in the options (fault drills only) wraps the client in a FaultyBackend that
    follows it."""
    root_dir = shared_root_dir(info.storage_options())
    if root_dir is not None and info.root_marker:
        check_marker(root_dir, info.namespace, info.root_marker, node)
    options = _with_overrides(info, _NO_OWN_EVICTION)
    backend = create_backend(info.spec.backend, rank_target(info, heads), options)
    fault_file = getattr(options, "fault_file", "")
    if fault_file:
        log.warning("L3 client of namespace %s follows the fault file %s (a fault drill)",
                    info.namespace, fault_file)
        return FaultyBackend(backend, rules_file=fault_file)
    return backend


class _PlaceholderPool:
    """Two pages of tiny objects: lets an admin client name (and delete) objects, nothing
    more."""

    num_pages = 2

    def __init__(self, num_heads: int, num_parts: int) -> None:
        self._per_page = num_heads * num_parts
        self._num_parts = num_parts
        self._buf = torch.zeros(2 * self._per_page * _PLACEHOLDER_PART_BYTES, dtype=torch.uint8)

    def page_head_view(self, page: int, head: int, part: int) -> torch.Tensor:
        at = (page * self._per_page + head * self._num_parts + part) * _PLACEHOLDER_PART_BYTES
        return self._buf[at:at + _PLACEHOLDER_PART_BYTES]

    def data_ptr(self) -> int:
        return self._buf.data_ptr()

    @property
    def nbytes(self) -> int:
        return self._buf.numel()


def admin_options(info: NamespaceInfo) -> StorageOptions:
    return _with_overrides(info, _ADMIN_OVERRIDES)


def _with_overrides(info: NamespaceInfo,
                    table: dict[StorageBackendKind, dict[str, int]]) -> StorageOptions:
    opts = info.storage_options()
    overrides = table.get(info.spec.backend, {})
    return dataclasses.replace(opts, **overrides) if overrides else opts  # type: ignore[type-var]


class BackendPageStore:
    """The admin client of one namespace: `delete` removes every head's objects of a page."""

    def __init__(self, info: NamespaceInfo, pool: str = KV_POOL,
                 num_parts: int = len(PagePart)) -> None:
        self.info, self.pool, self.num_parts = info, pool, num_parts
        # a hybrid model's pages have sliding-window objects too: they go with the page
        self._pools = (pool, SWA_POOL) if info.spec.sliding and pool == KV_POOL else (pool,)
        self.listable = backend_class(info.spec.backend).capabilities.listable
        self._options = admin_options(info)
        self._admin: StorageBackend | None = None
        if self.listable or info.spec.capacity_pages:
            self._client()

    def _client(self) -> StorageBackend:
        if self._admin is None:
            heads = HeadRange.all_of(self.info.spec.kv_heads)
            client = create_backend(self.info.spec.backend, rank_target(self.info, heads),
                                    self._options)
            try:
                for pool in self._pools:
                    client.register_pool(pool, _PlaceholderPool(heads.count, self.num_parts),
                                         self.num_parts)
            except BaseException:
                client.close()
                raise
            self._admin = client
        return self._admin

    def delete(self, hashes: Sequence[str]) -> int:
        """Remove every head's objects of `hashes`; returns how many pages had any."""
        if not hashes:
            return 0
        client = self._client()
        removed = client.delete(list(hashes), (self.pool,))
        if len(self._pools) > 1:
            client.delete(list(hashes), self._pools[1:])
        return removed

    def list_pages(self) -> dict[str, set[int]]:
        """Page hash -> KV heads whose parts are all stored (NotImplementedError if not
        listable)."""
        return self._client().list_pages(self.pool)

    def reclaim_old_format(self) -> int:
        """Remove format-1 objects of this namespace's model; how many pages went."""
        return self._client().reclaim_old_format(self.pool) if self.listable else 0

    def close(self) -> None:
        if self._admin is not None:
            try:
                self._admin.close()
            except Exception as exc:  # noqa: BLE001 - nothing else to close
                log.warning("closing the %s admin client of %s failed: %s",
                            self.info.spec.backend, self.info.namespace, exc)
        self._admin = None
