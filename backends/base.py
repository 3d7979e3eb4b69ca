"""The one L3 storage interface: batch-first, zero-copy into registered host pools.

A backend serves one `StorageTarget` (namespace + the KV heads it owns). Host pools are
registered once (`register_pool`); after that every transfer names pages of a registered pool,
and the backend reads or writes the pool's memory in place: no intermediate copies of page
bytes.

Objects (one per KV head and part, named by the global head) and the old format: see
object_names.

Ownership: the host pool's memory belongs to the caller. During `get_into`/`set_from` the
backend borrows the named pages; it keeps no reference to them after the call returns.
Thread safety: a backend instance is used by one thread at a time (the cache's storage
worker); several processes may share the same storage (files, a Mooncake cluster) safely.
Failure: a page that is absent, torn, corrupt or foreign is a miss (False / not counted),
never an exception and never wrong bytes. Exceptions are for misuse (unregistered pool,
mismatched lists) and for a backend that cannot be reached at all (`StorageUnavailable`).
"""
from __future__ import annotations

import abc
import re
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Mapping, NamedTuple, Protocol, Sequence

import torch

from kvtier.backends.object_names import (ObjectSlot, PagePart, StorageTarget,  # noqa: F401
                                          check_page_hash)
from kvtier.errors import CacheUsageError, KvtierError
from kvtier.policies import HitPolicy, StorageBackendKind

KV_POOL = "kv"
SWA_POOL = "swa"  # a hybrid model's sliding-window layers: objects of the pages ending hits
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_POOL_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class StorageUnavailable(KvtierError, RuntimeError):
    """The backend cannot be reached or started (raised at attach, not per page)."""


class PagesStillInUse(StorageUnavailable):
    """A backend call gave up while the storage may still read or write the host pages it
    was given (a transfer that timed out and could not be cancelled): the caller must not
    reuse those pages (they stay quarantined) until `pending`, where the backend can tell,
    is done; with no `pending`, never."""

    def __init__(self, message: str, pending: Future | None = None) -> None:
        super().__init__(message)
        self.pending = pending  # the storage call still running on the pages, if known


class PagedPool(Protocol):
    """What a backend needs from a host pool (kvtier.tiers.host_pool.HostPool has it)."""

    num_pages: int

    def page_head_view(self, page: int, head: int, part: int) -> torch.Tensor:
        """One KV head's (local index) K or V bytes of one page: a contiguous uint8 run."""
        ...

    def data_ptr(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


def check_pool_name(name: str) -> str:
    if not isinstance(name, str) or not _POOL_RE.match(name):
        raise CacheUsageError(f"pool names are short lowercase identifiers, got {name!r:.40}")
    return name


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do, so callers test features instead of backend names."""

    zero_copy: bool  # reads/writes go straight to registered host memory
    shared: bool  # other processes/instances see the same objects
    persistent: bool  # objects survive a restart of every kvtier process
    verified: bool  # every read is checked against a stored checksum
    bounded: bool  # enforces a capacity with eviction
    max_batch_pages: int = 128
    listable: bool = False  # list_pages works (the L3 directory can be rebuilt from storage)


class PoolRegistration(NamedTuple):
    name: str
    pool: PagedPool
    num_parts: int
    hit_policy: HitPolicy
    window_pages: int  # TRAILING_PAGES: how many trailing pages must be present
    slots: tuple[ObjectSlot, ...] = ()  # the objects of one page, in order (target.slots)

    def view(self, page: int, index: int) -> torch.Tensor:
        """The host bytes of object `index` (of `slots`) of host page `page`, in place."""
        slot = self.slots[index]
        return self.pool.page_head_view(page, slot.local_head, slot.part)


class ExistsResult(NamedTuple):
    """Leading pages present per pool, and the usable prefix (MIN over the pools asked)."""

    pool_pages: Mapping[str, int]
    usable_pages: int


class TransferResult(NamedTuple):
    """Per-page success of a batch; `leading_ok` pages form the usable prefix."""

    ok: list[bool]
    bytes_moved: int

    @property
    def leading_ok(self) -> int:
        n = 0
        for good in self.ok:
            if not good:
                break
            n += 1
        return n


@dataclass
class BackendStats:
    """Monotonic counters every backend keeps."""

    pages_written: int = 0
    pages_read: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    objects_written: int = 0  # of the pages written: one per owned KV head and part
    objects_read: int = 0  # of the pages read whole (bytes_read / objects_read: an object's)
    read_s: float = 0.0  # time inside get_into (what a read rate is measured over)
    write_s: float = 0.0  # time inside set_from
    write_skipped_existing: int = 0
    write_failures: int = 0
    read_misses: int = 0
    corrupt_objects: int = 0  # checksum/size/key mismatches found (and removed) on read
    evicted_pages: int = 0
    deleted_pages: int = 0
    stored_bytes: int = 0  # current, where the backend can tell
    extra: dict = field(default_factory=dict)


def leading_present(present: Sequence[bool], policy: HitPolicy, window_pages: int = 1) -> int:
    """Usable prefix length (pages) of one pool from per-page presence.

    ALL_PAGES: every page of the prefix. TRAILING_PAGES: only the last `window_pages` pages
    of the prefix (sliding-window or state pools): the longest n whose trailing window exists.
    """
    if policy is HitPolicy.ALL_PAGES:
        n = 0
        for p in present:
            if not p:
                break
            n += 1
        return n
    for n in range(len(present), 0, -1):
        if all(present[max(0, n - window_pages):n]):
            return n
    return 0


class StorageBackend(abc.ABC):
    """Base class of every L3 backend. Subclasses implement the five `_`-methods."""

    kind: StorageBackendKind
    capabilities: Capabilities

    def __init__(self, target: StorageTarget) -> None:
        self.target = target
        self.pools: dict[str, PoolRegistration] = {}
        self.counters = BackendStats()
        self.closed = False

    # ---- registration --------------------------------------------------------------------
    def register_pool(self, name: str, pool: PagedPool, num_parts: int = 2,
                      hit_policy: HitPolicy = HitPolicy.ALL_PAGES, window_pages: int = 1) -> None:
        """Register host memory once; later transfers name the pool and its page ids."""
        self._check_open()
        check_pool_name(name)
        layout = getattr(pool, "layout", None)
        if layout is not None and not layout.is_head_major:
            raise CacheUsageError(
                f"the {self.kind} backend stores each KV head of a page part as one contiguous "
                f"object; the host pool's {layout} layout has none: use page_head")
        spec = getattr(pool, "spec", None)
        if spec is not None and spec.num_kv_heads != self.target.heads.count:
            raise CacheUsageError(
                f"the host pool holds {spec.num_kv_heads} KV heads but this backend's target "
                f"owns {self.target.heads.count} ({self.target.heads}); open the backend with "
                "the rank's own head range")
        if name in self.pools:
            raise CacheUsageError(f"pool {name!r} is already registered with this backend")
        reg = PoolRegistration(name, pool, num_parts, hit_policy, window_pages,
                               self.target.slots(num_parts))
        self._register(reg)
        self.pools[name] = reg

    def _pool(self, name: str) -> PoolRegistration:
        self._check_open()
        try:
            return self.pools[name]
        except KeyError:
            raise CacheUsageError(f"pool {name!r} is not registered; call register_pool first") from None

    # ---- the interface -------------------------------------------------------------------
    def exists(self, keys: Sequence[str], pools: Sequence[str] = (KV_POOL,)) -> ExistsResult:
        """How many leading pages of `keys` each pool holds (every part of this target's
        heads)."""
        per_pool = {}
        for name in pools:
            reg = self._pool(name)
            present = self._present(reg, [check_page_hash(k) for k in keys])
            per_pool[name] = leading_present(present, reg.hit_policy, reg.window_pages)
        return ExistsResult(per_pool, min(per_pool.values()) if per_pool else 0)

    def present(self, keys: Sequence[str], pool: str = KV_POOL) -> list[bool]:
        """Per page of `keys`: are all of this target's objects of it in `pool`?"""
        return self._present(self._pool(pool), [check_page_hash(k) for k in keys])

    def get_into(self, pool: str, keys: Sequence[str], host_pages: Sequence[int]) -> TransferResult:
        """Read pages into host pool pages; a page is ok only if every object (each owned
        head's parts) read and verified."""
        reg = self._pool(pool)
        self._check_batch(keys, host_pages)
        t0 = time.perf_counter()
        result = self._get(reg, list(keys), list(host_pages))
        self.counters.read_s += time.perf_counter() - t0
        good = sum(result.ok)
        self.counters.pages_read += good
        self.counters.objects_read += good * len(reg.slots)
        self.counters.read_misses += len(result.ok) - good
        self.counters.bytes_read += result.bytes_moved
        return result

    def set_from(self, pool: str, keys: Sequence[str], host_pages: Sequence[int]) -> TransferResult:
        """Write host pool pages; existing objects are kept (a page's bytes never change)."""
        reg = self._pool(pool)
        self._check_batch(keys, host_pages)
        t0 = time.perf_counter()
        result = self._set(reg, list(keys), list(host_pages))
        self.counters.write_s += time.perf_counter() - t0
        self.counters.pages_written += sum(result.ok)
        self.counters.objects_written += sum(result.ok) * len(reg.slots)
        self.counters.write_failures += len(result.ok) - sum(result.ok)
        self.counters.bytes_written += result.bytes_moved
        return result

    def delete(self, keys: Sequence[str], pools: Sequence[str] = (KV_POOL,)) -> int:
        """Remove the pages' objects (this target's heads); returns how many pages had any."""
        removed = 0
        for name in pools:
            removed += self._delete(self._pool(name), [check_page_hash(k) for k in keys])
        self.counters.deleted_pages += removed
        return removed

    def list_pages(self, pool: str = KV_POOL) -> dict[str, set[int]]:
        """Every page of this target's namespace in `pool`: page hash -> the global KV heads
        whose parts are ALL present (any head of the model, not only this target's), oldest
        first where the backend can tell.

        An admin call (the L3 namespace rebuilds its page directory with it): it needs no
        registered pool, and its cost grows with the objects stored. Only backends whose
        `capabilities.listable` is True implement it; the others raise NotImplementedError.
        """
        self._check_open()
        check_pool_name(pool)
        if not self.capabilities.listable:
            raise NotImplementedError(
                f"the {self.kind} backend cannot list its pages; the L3 directory of a "
                "namespace on it starts empty after a restart")
        reg = self.pools.get(pool)
        return self._list_pages(pool, reg.num_parts if reg else len(PagePart))

    def reclaim_old_format(self, pool: str = KV_POOL) -> int:
        """Delete format-1 objects (named by TP rank and size) of this model: in this
        namespace and in every other namespace folder of the same model (module docstring).
        Returns how many old pages (per namespace) went; 0 for backends that cannot list."""
        self._check_open()
        check_pool_name(pool)
        if not self.capabilities.listable:
            return 0
        return self._reclaim_old_format(pool)

    def stats(self) -> BackendStats:
        return self.counters

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._close()

    def __enter__(self) -> "StorageBackend":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise CacheUsageError(f"the {self.kind} backend is closed; attach a new one")

    def _check_batch(self, keys: Sequence[str], host_pages: Sequence[int]) -> None:
        if len(keys) != len(host_pages):
            raise CacheUsageError(f"{len(keys)} keys but {len(host_pages)} host pages")
        for k in keys:
            check_page_hash(k)

    def names(self, reg: PoolRegistration, key: str) -> list[str]:
        """Object names of one page: every part of every head this target owns, in slot order."""
        return [self.target.object_name(reg.name, key, s.head, s.part) for s in reg.slots]

    # ---- what a backend implements -------------------------------------------------------
    def _register(self, reg: PoolRegistration) -> None:
        """Register the pool's memory with the storage engine (no-op for plain files)."""

    @abc.abstractmethod
    def _present(self, reg: PoolRegistration, keys: list[str]) -> list[bool]:
        """Per page: are all its objects of this target present (cheap check; reads verify)."""

    @abc.abstractmethod
    def _get(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]) -> TransferResult:
        ...

    @abc.abstractmethod
    def _set(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]) -> TransferResult:
        ...

    @abc.abstractmethod
    def _delete(self, reg: PoolRegistration, keys: list[str]) -> int:
        ...

    def _list_pages(self, pool: str, num_parts: int) -> dict[str, set[int]]:
        """Listable backends: page hash -> complete heads (see list_pages, page_heads)."""
        raise NotImplementedError

    def _reclaim_old_format(self, pool: str) -> int:
        """Listable backends: remove format-1 objects of this model (see reclaim_old_format)."""
        raise NotImplementedError

    def _close(self) -> None:
        """Release engine resources (stop a master this backend started)."""
