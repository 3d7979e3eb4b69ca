"""The one L3 storage interface: batch-first, zero-copy into registered host pools.

A backend serves one `StorageTarget` (namespace + TP rank/size). Host pools are registered
once (`register_pool`); after that every transfer names pages of a registered pool, and the
backend reads or writes the pool's memory in place: no intermediate copies of page bytes.

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
import enum
import re
import time
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple, Protocol, Sequence

import torch

from kvtier.errors import CacheUsageError, KvtierError
from kvtier.keys import KeyNamespace
from kvtier.policies import HitPolicy, StorageBackendKind

KV_POOL = "kv"
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_POOL_RE = re.compile(r"^[a-z][a-z0-9_]{0,31}$")
_OBJECT_RE = re.compile(r"^([0-9a-f]{64})_(\d{1,4})_(\d{1,4})_([kv])$")  # object_name's last part


class StorageUnavailable(KvtierError, RuntimeError):
    """The backend cannot be reached or started (raised at attach, not per page)."""


class PagesStillInUse(StorageUnavailable):
    """A backend call gave up while the storage may still read or write the host pages it
    was given (a transfer that timed out and could not be cancelled): the caller must never
    reuse those pages (they stay quarantined)."""


class PagePart(enum.IntEnum):
    """A page of the KV pool is two objects: its K bytes and its V bytes (all layers)."""

    K = 0
    V = 1

    @property
    def suffix(self) -> str:
        return "k" if self is PagePart.K else "v"


class PagedPool(Protocol):
    """What a backend needs from a host pool (kvtier.tiers.host_pool.HostPool has it)."""

    num_pages: int

    def page_part_view(self, page: int, part: int) -> torch.Tensor: ...

    def data_ptr(self) -> int: ...

    @property
    def nbytes(self) -> int: ...


@dataclass(frozen=True)
class StorageTarget:
    """Whose objects: a namespace, and the TP rank/size whose shard they hold."""

    namespace: KeyNamespace
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if not (isinstance(self.tp_size, int) and isinstance(self.tp_rank, int)
                and self.tp_size >= 1 and 0 <= self.tp_rank < self.tp_size):
            raise CacheUsageError(f"bad TP rank/size {self.tp_rank}/{self.tp_size}")

    def object_name(self, pool: str, page_hash: str, part: int, rank: int | None = None) -> str:
        """`<namespace>/<pool>/<hash>_<rank>_<size>_<k|v>`: nothing in it is client text.

        The namespace name is validated (KeyNamespace), the hash must be 64 hex digits and
        the pool a short identifier, so no name can become `..` or reach another namespace.
        """
        check_page_hash(page_hash)
        r = self.tp_rank if rank is None else rank
        return f"{self.namespace.name}/{pool}/{page_hash}_{r}_{self.tp_size}_{PagePart(part).suffix}"


def check_page_hash(page_hash: str) -> str:
    if not isinstance(page_hash, str) or not _HASH_RE.match(page_hash):
        raise CacheUsageError(f"page keys are 64 lowercase hex digits, got {page_hash!r:.80}")
    return page_hash


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


def page_ranks(basenames: Iterable[str], tp_size: int,
               num_parts: int = len(PagePart)) -> dict[str, set[int]]:
    """Group object basenames (`<hash>_<rank>_<size>_<k|v>`) of one namespace/pool into
    page hash -> TP ranks whose every part is among them. Objects of another TP size and
    names that are not objects are ignored; pages keep the order they first appear in."""
    want = {PagePart(p).suffix for p in range(num_parts)}
    parts: dict[str, dict[int, set[str]]] = {}
    for base in basenames:
        m = _OBJECT_RE.match(base)
        if m and int(m.group(3)) == tp_size and int(m.group(2)) < tp_size:
            parts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), set()).add(m.group(4))
    out = {h: {r for r, found in ranks.items() if want <= found} for h, ranks in parts.items()}
    return {h: ranks for h, ranks in out.items() if ranks}


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
        if layout is not None and not layout.is_page_major:
            raise CacheUsageError(
                f"the {self.kind} backend stores each page part as one contiguous object; "
                f"the host pool's {layout} layout has none: use page_first or page_first_direct")
        if name in self.pools:
            raise CacheUsageError(f"pool {name!r} is already registered with this backend")
        reg = PoolRegistration(name, pool, num_parts, hit_policy, window_pages)
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
        """How many leading pages of `keys` each pool holds (all parts, this rank)."""
        per_pool = {}
        for name in pools:
            reg = self._pool(name)
            present = self._present(reg, [check_page_hash(k) for k in keys])
            per_pool[name] = leading_present(present, reg.hit_policy, reg.window_pages)
        return ExistsResult(per_pool, min(per_pool.values()) if per_pool else 0)

    def get_into(self, pool: str, keys: Sequence[str], host_pages: Sequence[int]) -> TransferResult:
        """Read pages into host pool pages; a page is ok only if every part read and verified."""
        reg = self._pool(pool)
        self._check_batch(keys, host_pages)
        t0 = time.perf_counter()
        result = self._get(reg, list(keys), list(host_pages))
        self.counters.read_s += time.perf_counter() - t0
        good = sum(result.ok)
        self.counters.pages_read += good
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
        self.counters.write_failures += len(result.ok) - sum(result.ok)
        self.counters.bytes_written += result.bytes_moved
        return result

    def delete(self, keys: Sequence[str], pools: Sequence[str] = (KV_POOL,)) -> int:
        """Remove the pages' objects (this rank); returns how many pages had objects."""
        removed = 0
        for name in pools:
            removed += self._delete(self._pool(name), [check_page_hash(k) for k in keys])
        self.counters.deleted_pages += removed
        return removed

    def list_pages(self, pool: str = KV_POOL) -> dict[str, set[int]]:
        """Every page of this target's namespace in `pool`: page hash -> the TP ranks (of this
        target's tp_size) whose parts are ALL present, oldest first where the backend can tell.

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
        """Object names of every part of one page (this rank)."""
        return [self.target.object_name(reg.name, key, part) for part in range(reg.num_parts)]

    # ---- what a backend implements -------------------------------------------------------
    def _register(self, reg: PoolRegistration) -> None:
        """Register the pool's memory with the storage engine (no-op for plain files)."""

    @abc.abstractmethod
    def _present(self, reg: PoolRegistration, keys: list[str]) -> list[bool]:
        """Per page: are all parts of this rank present (cheap check; reads verify)."""

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
        """Listable backends: page hash -> complete ranks (see list_pages, page_ranks)."""
        raise NotImplementedError

    def _close(self) -> None:
        """Release engine resources (stop a master this backend started)."""
