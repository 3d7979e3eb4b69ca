"""A deterministic in-memory backend with a bandwidth/latency model, for GPU-free tests.

Objects live in a dict shared by every instance in the process with the same `seed` (so two
"instances" of one test see one store). Time is modelled, not slept: `simulated_s` grows by
`latency_s + bytes / bandwidth` per batch, which policy experiments read as the L3 cost.
"""
from __future__ import annotations

import threading

import xxhash

from kvtier.backends.base import (Capabilities, PoolRegistration, StorageBackend, StorageTarget,
                                  TransferResult)
from kvtier.backends.object_names import old_format_pages, page_heads, same_model_namespace
from kvtier.policies import StorageBackendKind
from kvtier.storage_options import SimulatedOptions

_STORES: dict[int, dict[str, tuple[bytes, int]]] = {}  # name -> (bytes, xxh3_64)
_LOCK = threading.Lock()


class SimulatedBackend(StorageBackend):
    kind = StorageBackendKind.SIMULATED
    capabilities = Capabilities(zero_copy=False, shared=True, persistent=False, verified=True,
                                bounded=True, listable=True)

    def __init__(self, options: SimulatedOptions, target: StorageTarget) -> None:
        super().__init__(target)
        self.options = options
        with _LOCK:
            self._store = _STORES.setdefault(options.seed, {})
        self._order: list[str] = []  # insertion order, for the capacity bound
        self.simulated_s = 0.0

    def _charge(self, nbytes: int) -> None:
        self.simulated_s += self.options.latency_s + nbytes / (self.options.bandwidth_gbps * 1e9)

    def _present(self, reg: PoolRegistration, keys: list[str]) -> list[bool]:
        self._charge(0)
        with _LOCK:
            return [all(n in self._store for n in self.names(reg, k)) for k in keys]

    def _get(self, reg, keys, host_pages) -> TransferResult:
        ok, moved = [], 0
        for key, page in zip(keys, host_pages):
            views = [reg.view(page, i) for i in range(len(reg.slots))]
            with _LOCK:
                blobs = [self._store.get(n) for n in self.names(reg, key)]
            good = all(b is not None for b in blobs)
            if good and any(len(b[0]) != v.numel() for b, v in zip(blobs, views)):
                good = False  # torn: wrong size
            elif good:
                for (blob, _), view in zip(blobs, views):
                    view.numpy()[:] = memoryview(blob)
                    moved += len(blob)
                # verify what landed, as the file backend does
                good = all(xxhash.xxh3_64_intdigest(v.numpy()) == b[1] for b, v in zip(blobs, views))
            if not good and all(b is not None for b in blobs):
                self.counters.corrupt_objects += 1  # a bad object is dropped, then a miss
                self._delete(reg, [key])
            ok.append(good)
        self._charge(moved)
        return TransferResult(ok, moved)

    def _set(self, reg, keys, host_pages) -> TransferResult:
        ok, moved = [], 0
        for key, page in zip(keys, host_pages):
            names = self.names(reg, key)
            with _LOCK:
                if all(n in self._store for n in names):
                    self.counters.write_skipped_existing += 1
                    ok.append(True)
                    continue
                for i, name in enumerate(names):
                    data = reg.view(page, i).numpy().tobytes()
                    self._store[name] = (data, xxhash.xxh3_64_intdigest(data))
                    self._order.append(name)
                    moved += len(data)
                self._evict_over_capacity(reg)
            ok.append(True)
        self._charge(moved)
        return TransferResult(ok, moved)

    def _evict_over_capacity(self, reg: PoolRegistration) -> None:
        cap = self.options.capacity_pages * reg.num_parts * self.target.heads.total
        while cap and len(self._store) > cap and self._order:
            name = self._order.pop(0)
            if self._store.pop(name, None) is not None:
                self.counters.evicted_pages += 1

    def _delete(self, reg, keys) -> int:
        removed = 0
        with _LOCK:
            for key in keys:
                hit = [self._store.pop(n, None) is not None for n in self.names(reg, key)]
                removed += any(hit)
        return removed

    def _list_pages(self, pool: str, num_parts: int) -> dict[str, set[int]]:
        prefix = f"{self.target.namespace.name}/{pool}/"
        with _LOCK:  # insertion order: oldest first
            bases = [n[len(prefix):] for n in self._store if n.startswith(prefix)]
        return page_heads(bases, self.target.heads.total, num_parts)

    def _reclaim_old_format(self, pool: str) -> int:
        """Format-1 objects of this model's namespaces (any salt or fingerprint) go."""
        pages = 0
        with _LOCK:
            by_dir: dict[str, list[str]] = {}
            for name in self._store:
                folder, _, rest = name.partition("/")
                pool_dir, _, base = rest.partition("/")
                if pool_dir == pool and same_model_namespace(folder, self.target.namespace):
                    by_dir.setdefault(f"{folder}/{pool}", []).append(base)
            for rel_dir, bases in by_dir.items():
                for old in old_format_pages(bases).values():
                    for base in old:
                        self._store.pop(f"{rel_dir}/{base}", None)
                    pages += 1
        return pages

    def corrupt(self, name: str, data: bytes) -> None:
        """Test hook: replace an object's bytes, keeping its old checksum (bit rot)."""
        with _LOCK:
            self._store[name] = (data, self._store[name][1])
