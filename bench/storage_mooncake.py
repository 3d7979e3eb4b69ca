"""Mooncake backend against raw Mooncake Store calls on the same bytes, measured in one run.

Raw = `batch_put_from` / `batch_get_into` of every object of a page (one per KV head and
part, the pool in the page_head layout as under L3), pointers computed up front, on
the backend's own client and its registered host pool (same buffer, same sizes, same
segment, the backend's replica count). kvtier = `MooncakeBackend.set_from` / `get_into` of
the same pages in one batch (existence check, pointers and size checks included). One
client holds the only segment, so both sides move bytes within this process. Each round
writes fresh objects, reads them back and removes them, alternating which side goes first;
best of `repeats` after a warm-up round that faults the segment in. kvtier is measured
twice, on backends of their own, each beside a raw run of its own: with `verify_checksums`
on, the default (`write_gbps`, `read_gbps`, `*_ratio`), and off (`unverified_*`), as the
file and nixl benches name them (bench/storage_measure). `*_ratio` = kvtier GB/s / raw
GB/s; the target is >= 0.8 verified, 0.9 not.

Per-object figures (`objects`): the objects a page is stored as (one per KV head and part;
with verification each also carries its part's 8-byte checksum), their bytes, the Mooncake
calls one `set_from` / `get_into` of the whole batch makes (counted on the client: verified
batches go in lanes of several calls) and objects moved per second, for kvtier with and without
verification and for the raw calls.
"""
from __future__ import annotations

import hashlib
from typing import Any, Callable, NamedTuple

import torch

from kvtier.backends.base import KV_POOL, StorageTarget, TransferResult
from kvtier.backends.mooncake_backend import MooncakeBackend
from kvtier.backends.mooncake_master import MooncakeMaster
from kvtier.bench.storage_measure import BatchShape, bandwidth, per_object, timed
from kvtier.errors import KvtierError
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.policies import MemLayout
from kvtier.storage_options import MiB, MooncakeOptions
from kvtier.tiers.host_pool import HostPool

# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims x 64 tokens x bf16 = 737,280 B per part.
SPEC = KVSpec(num_layers=30, num_kv_heads=3, head_dim=64, page_size=64, dtype=torch.bfloat16)
EXISTS_KEYS = 1000
FILL = 0.8  # puts past ~90% of the segment fail with -200: keep one side's objects under this


def measure(pages: int, repeats: int = 5) -> dict:
    """Write/read GB/s of raw Mooncake calls and of the backend, their ratios, exists latency."""
    if pages < 1 or repeats < 1:
        raise KvtierError(f"measure needs pages >= 1 and repeats >= 1, got {pages}, {repeats}")
    segment = -(-int(pages * SPEC.page_bytes / FILL) // MiB) * MiB + 64 * MiB
    keys = [hashlib.sha256(f"bench-page-{i}".encode()).hexdigest() for i in range(pages)]
    with MooncakeMaster() as master, HostPool(SPEC, 2 * pages, MemLayout.PAGE_HEAD) as pool:
        flat = pool.kv.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(0)))
        base = dict(master_address=master.address, global_segment_size_bytes=segment,
                    local_buffer_size_bytes=0)
        plain = _measure_backend(MooncakeOptions(**base, verify_checksums=False), pool, keys,
                                 repeats)
        checked = _measure_backend(MooncakeOptions(**base, verify_checksums=True), pool, keys,
                                   repeats)
    total = pages * SPEC.page_bytes
    out = _figures(checked.best, total, "")  # the default: verified, against its own raw run
    out["exists_1000_ms"] = round(checked.best["exists"] * 1e3, 3)
    out.update(page_bytes=SPEC.page_bytes, pages=pages, layout=MemLayout.PAGE_HEAD.value,
               objects_per_page=2 * SPEC.num_kv_heads)
    out.update(_figures(plain.best, total, "unverified_"))
    out["objects"] = {"raw": _per_object(checked, pages, "raw"),
                      "kvtier_verified": _per_object(checked, pages, "kv"),
                      "kvtier_unverified": _per_object(plain, pages, "kv")}
    return out


class _Measured(NamedTuple):
    best: dict[str, float]  # best seconds of raw_w, raw_r, kv_w, kv_r, exists
    objects: dict[str, int]  # objects one batch moves: raw_w, raw_r, kv_w, kv_r
    object_bytes: dict[str, int]  # their bytes, all together
    calls: dict[str, int]  # Mooncake calls one batch makes


def _per_object(m: _Measured, pages: int, side: str) -> dict:
    w, r = side + "_w", side + "_r"
    shape = BatchShape(m.objects[w], m.object_bytes[w] // max(1, m.objects[w]), m.calls[w],
                       m.calls[r])
    return per_object(shape, pages, m.best[w], m.best[r])


class _CountingStore:
    """The backend's Mooncake client, counting the calls made through it."""

    def __init__(self, store: Any) -> None:
        self._store = store
        self.calls = 0
        self.objects = 0
        self.object_bytes = 0

    @property
    def unwrapped(self) -> Any:
        return self._store

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not name.startswith("batch_") and name not in ("get_size", "put_from", "get_into"):
            return attr

        def counted(*args: Any, **kw: Any) -> Any:
            self.calls += 1
            if name in ("batch_put_from", "batch_get_into"):
                self.objects += len(args[0])
                self.object_bytes += sum(args[2])
            elif name in ("batch_put_from_multi_buffers", "batch_get_into_multi_buffers"):
                self.objects += len(args[0])  # an object's buffers: its part, its checksum
                self.object_bytes += sum(sum(sizes) for sizes in args[2])
            return attr(*args, **kw)
        return counted


def _figures(best: dict[str, float], total: int, prefix: str) -> dict:
    g = {k: total / best[k] / 1e9 for k in ("raw_w", "raw_r", "kv_w", "kv_r")}
    return bandwidth(g["kv_w"], g["kv_r"], g["raw_w"], g["raw_r"], prefix=prefix)


def _measure_backend(options: MooncakeOptions, pool: HostPool, keys: list[str],
                     repeats: int) -> _Measured:
    """Best seconds of raw/kvtier writes and reads (pages 0..n-1 -> n..2n-1) and of exists,
    and what one batch of each moves in how many calls (counted in the first round)."""
    n = len(keys)
    src, dst = list(range(n)), list(range(n, 2 * n))
    ns = KeyNamespace("bench/storage-mooncake", "", "bench")
    heads = HeadRange.all_of(SPEC.num_kv_heads)
    objects = [(h, part) for h in range(heads.count) for part in (0, 1)]
    with MooncakeBackend(options, StorageTarget(ns, heads)) as backend:
        backend.register_pool(KV_POOL, pool)
        counting = _CountingStore(backend.store)
        backend.store = counting  # counted: the calls each path makes
        store = counting  # the same client and registered pool: only the path differs
        names = [f"bench-raw/{i}_{h}_{part}" for i in range(n) for h, part in objects]
        sizes = [SPEC.page_part_bytes // heads.count] * len(names)
        put_ptrs = [pool.page_head_view(p, h, part).data_ptr() for p in src for h, part in objects]
        get_ptrs = [pool.page_head_view(p, h, part).data_ptr() for p in dst for h, part in objects]
        ops: dict[str, Callable[[], object]] = {
            "raw_w": lambda: _raw(store.batch_put_from(names, put_ptrs, sizes,
                                                       backend.replicate), sizes, 0),
            "raw_r": lambda: _raw(store.batch_get_into(names, get_ptrs, sizes), sizes, None),
            "kv_w": lambda: _check(backend.set_from(KV_POOL, keys, src)),
            "kv_r": lambda: _check(backend.get_into(KV_POOL, keys, dst)),
        }
        probe = [keys[i % n] for i in range(EXISTS_KEYS)]
        best = {k: float("inf") for k in (*ops, "exists")}
        calls, objects, object_bytes = {}, {}, {}
        for rnd in range(repeats + 1):  # round 0 warms the segment up and is not counted
            spent = {}
            for side in (("raw", "kv") if rnd % 2 == 0 else ("kv", "raw")):
                for phase in ("_w", "_r"):
                    before = (counting.calls, counting.objects, counting.object_bytes)
                    spent[side + phase] = timed(ops[side + phase])
                    if rnd == 0:
                        calls[side + phase] = counting.calls - before[0]
                        objects[side + phase] = counting.objects - before[1]
                        object_bytes[side + phase] = counting.object_bytes - before[2]
                if side == "kv":
                    spent["exists"] = timed(lambda: backend.exists(probe))
                    backend.delete(keys)
                else:
                    store.batch_remove(names, True)
            if rnd:
                best = {k: min(best[k], spent[k]) for k in best}
        backend.store = counting.unwrapped  # closed as it was opened
        if not all(torch.equal(pool.page_part_view(s, part), pool.page_part_view(d, part))
                   for s, d in zip(src, dst) for part in (0, 1)):
            raise KvtierError("mooncake bench: pages read back differ from the pages written")
    return _Measured(best, objects, object_bytes, calls)


def _raw(rcs: list[int], sizes: list[int], want: int | None) -> None:
    expected = sizes if want is None else [want] * len(sizes)
    if list(rcs) != expected:
        raise KvtierError(f"mooncake bench: raw call failed: {sorted(set(rcs))[:5]}")


def _check(result: TransferResult) -> None:
    if not all(result.ok):
        raise KvtierError(f"mooncake bench: {result.ok.count(False)} pages failed; see the log")
