"""The L3 namespace's own clients of a namespace's storage: delete whole pages, list pages.

Why one client per TP rank: a backend names (and deletes) only the objects of its own
`StorageTarget` rank, and an evicted page must go whole (every part of every rank), or the
ranks' MIN agreement hides it while the remaining parts keep using space. Each admin client
registers a tiny placeholder pool so `delete` can name its objects; none of them ever moves
page bytes. Listing needs one client: it sees every rank's objects.

Clients open lazily: rank 0 at attach when the namespace can need it (listable storage, or a
quota), so a namespace whose storage cannot be reached fails at registration with the
backend's own error; the others at the first delete. (A Mooncake client listens on every
interface for its transfer engine: the actor opens none unless it must delete.) Admin
clients hold no data and never evict on their own: byte bounds are set to 0 (unbounded) and
a Mooncake admin client contributes no segment.

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

from kvtier.backends.base import KV_POOL, PagePart, StorageBackend, StorageTarget
from kvtier.backends.registry import backend_class, create_backend
from kvtier.backends.shared_root import check_marker, shared_root_dir
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

    def close(self) -> None: ...


def rank_target(info: NamespaceInfo, tp_rank: int) -> StorageTarget:
    """The storage target of one TP rank of a namespace's writers."""
    return StorageTarget(info.spec.key_namespace, tp_rank, info.spec.tp_size)


def open_rank_backend(info: NamespaceInfo, tp_rank: int,
                      node: str | None = None) -> StorageBackend:
    """The backend client a rank uses for a namespace (pages move rank <-> storage directly),
    with the backend's own eviction off: the namespace's directory evicts (module docstring).

    A file or nixl root is first checked to be the one the namespace actor sees (its marker
    read back; RootNotShared naming `node`, default this host's name, when it is not)."""
    root_dir = shared_root_dir(info.storage_options())
    if root_dir is not None and info.root_marker:
        check_marker(root_dir, info.namespace, info.root_marker, node)
    return create_backend(info.spec.backend, rank_target(info, tp_rank),
                          _with_overrides(info, _NO_OWN_EVICTION))


class _PlaceholderPool:
    """One page of tiny parts: lets an admin client name (and delete) objects, nothing more."""

    num_pages = 1

    def __init__(self, num_parts: int) -> None:
        self._buf = torch.zeros(num_parts * _PLACEHOLDER_PART_BYTES, dtype=torch.uint8)

    def page_part_view(self, page: int, part: int) -> torch.Tensor:
        return self._buf[part * _PLACEHOLDER_PART_BYTES:(part + 1) * _PLACEHOLDER_PART_BYTES]

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
    """Admin clients of one namespace: `delete` removes every rank's objects of a page."""

    def __init__(self, info: NamespaceInfo, pool: str = KV_POOL,
                 num_parts: int = len(PagePart)) -> None:
        self.info, self.pool, self.num_parts = info, pool, num_parts
        self.listable = backend_class(info.spec.backend).capabilities.listable
        self._options = admin_options(info)
        self._clients: dict[int, StorageBackend] = {}
        if self.listable or info.spec.capacity_pages:
            self._client(0)

    def _client(self, rank: int) -> StorageBackend:
        client = self._clients.get(rank)
        if client is None:
            client = create_backend(self.info.spec.backend, rank_target(self.info, rank),
                                    self._options)
            try:
                client.register_pool(self.pool, _PlaceholderPool(self.num_parts), self.num_parts)
            except BaseException:
                client.close()
                raise
            self._clients[rank] = client
        return client

    def delete(self, hashes: Sequence[str]) -> int:
        """Remove every rank's objects of `hashes`; returns (page, rank) object sets removed."""
        if not hashes:
            return 0
        return sum(self._client(r).delete(list(hashes), (self.pool,))
                   for r in range(self.info.spec.tp_size))

    def list_pages(self) -> dict[str, set[int]]:
        """Page hash -> ranks whose parts are all stored (NotImplementedError if not listable)."""
        return self._client(0).list_pages(self.pool)

    def close(self) -> None:
        for client in self._clients.values():
            try:
                client.close()
            except Exception as exc:  # noqa: BLE001 - closing the others matters more
                log.warning("closing the %s admin client of %s failed: %s",
                            self.info.spec.backend, self.info.namespace, exc)
        self._clients.clear()
