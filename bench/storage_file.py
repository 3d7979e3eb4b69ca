"""File backend against plain Python file I/O of the same bytes, measured in one run.

Raw = what any program does with files: `open(path, "wb").write(obj)` for every object of a
page (one per KV head and part: L3's objects, so pages of any TP size share them), then
`open(path, "rb").readinto(obj)` back into the same host-pool memory (single thread). The
pool is in the page_head layout, as under L3, so each object is one contiguous run.
kvtier = the FileBackend moving the same pages with `set_from` / `get_into` (header,
checksum, atomic no-replace publish; its own I/O threads), twice, on backends and
directories of their own: with `verify_checksums` on (the default: the top-level figures)
and off (`unverified_*`: reads skip the xxh3 comparison). Each round starts every side
from an emptied directory after `os.sync()`; reads are warm from the page cache for all
(dropping caches needs root). The sides take turns every CHUNK_PAGES pages, in rotating
order, so a burst of load from elsewhere on a shared machine lands on all. Per side and
chunk: the fastest of `repeats` rounds; GB/s = bytes / the sum of those. `*_ratio` = kvtier
GB/s / raw GB/s; the issue's target is >= 0.8 (storage_measure describes every figure).

A batch here is every page, moved CHUNK_PAGES pages per `set_from` / `get_into` call. Its
calls (`objects`' `*_calls_per_batch`) are the I/O calls made from Python: kvtier's, every
call to an `os` I/O function (each one system call), counted in an untimed extra round;
raw's, its open(), write() or readinto() and close() of each object (CPython 3.11's open()
itself makes four system calls, openat, fstat, ioctl and lseek: six per raw object).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import threading
from typing import Any, Callable

import torch

from kvtier.backends.base import KV_POOL, StorageTarget, TransferResult
from kvtier.backends.file_backend import DEFAULT_IO_THREADS, FileBackend
from kvtier.backends.file_object import object_bytes
from kvtier.bench.storage_measure import SIDES, VERIFY, BatchShape, report, rotated, timed
from kvtier.errors import ConfigError, KvtierError
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import SMOLLM2_135M, HeadRange, KVSpec
from kvtier.policies import MemLayout
from kvtier.storage_options import FileOptions
from kvtier.tiers.host_pool import HostPool

SPEC = KVSpec(**SMOLLM2_135M, page_size=64, dtype=torch.bfloat16)
PART_BYTES = SPEC.page_part_bytes // SPEC.num_kv_heads  # one object's payload: 245,760 B
LAYOUT = MemLayout.PAGE_HEAD  # L2's layout under L3: each KV head's part is one run
EXISTS_KEYS = 1000
CHUNK_PAGES = 32  # the sides take turns every 32 pages, so machine noise hits all of them
RAW_CALLS_PER_OBJECT = 3  # open(), then write() or readinto(), then close()
# The `os` functions that do I/O, each one system call (scandir: one per directory listed)
_OS_IO = ("open", "close", "read", "readv", "pread", "write", "writev", "pwrite", "stat",
          "lstat", "fstat", "link", "unlink", "rename", "replace", "mkdir", "rmdir", "fsync",
          "scandir", "truncate", "ftruncate")
_NAMESPACE = KeyNamespace("bench/storage-file", "", "bench")


def measure(pages: int, root_dir: str, repeats: int = 5,
            io_threads: int = DEFAULT_IO_THREADS) -> dict:
    """Write/read GB/s of raw files and of the file backend with and without verification,
    their ratios, per-object figures and exists latency."""
    if pages < 1 or repeats < 1:
        raise ConfigError(f"measure needs pages >= 1 and repeats >= 1, got {pages}, {repeats}")
    dirs = {side: os.path.join(root_dir, side) for side in SIDES}
    keys = [hashlib.sha256(f"bench-page-{i}".encode()).hexdigest() for i in range(pages)]
    chunks = [range(i, min(i + CHUNK_PAGES, pages)) for i in range(0, pages, CHUNK_PAGES)]
    # fastest time of each chunk over the rounds, per side and phase: a burst of load from
    # elsewhere spoils a chunk, not the whole figure (the min of timeit, chunk by chunk)
    best = {side + phase: [float("inf")] * len(chunks) for side in SIDES for phase in ("_w", "_r")}
    best_exists = float("inf")
    with HostPool(SPEC, pages, LAYOUT) as pool:
        flat = pool.kv.view(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8,
                                 generator=torch.Generator().manual_seed(0)))
        raw = _RawFiles(dirs["raw"], pool)
        for rnd in range(repeats):
            for path in dirs.values():
                _fresh(path)
            with contextlib.ExitStack() as stack:
                kvs = {side: stack.enter_context(_backend(dirs[side], verify, io_threads, pool))
                       for side, verify in VERIFY.items()}
                ops = {"raw_w": raw.write, "raw_r": raw.read}
                for side, kv in kvs.items():
                    ops.update(_ops(side, kv, keys))
                for phase in ("_w", "_r"):
                    for n, chunk in enumerate(chunks):  # rotate who goes first, chunk by chunk
                        for side in rotated(list(SIDES), n + rnd):
                            op = side + phase
                            best[op][n] = min(best[op][n], timed(lambda: ops[op](chunk)))
                probe = [keys[i % pages] for i in range(EXISTS_KEYS)]  # all present: 2000 stats
                best_exists = min(best_exists, timed(lambda: _check_exists(kvs["kv"], probe)))
        objects = pages * len(raw.parts[0])
        calls = RAW_CALLS_PER_OBJECT * objects
        shapes = {"raw": BatchShape(objects, PART_BYTES, calls, calls)}
        for side, verify in VERIFY.items():
            _fresh(dirs[side])
            with _backend(dirs[side], verify, io_threads, pool) as kv:
                shapes[side] = _count_calls(kv, keys, chunks, objects)
        for path in dirs.values():
            shutil.rmtree(path, ignore_errors=True)
    return {
        **report({op: sum(times) for op, times in best.items()}, pages * SPEC.page_bytes,
                 pages, shapes),
        "exists_1000_ms": round(best_exists * 1e3, 3),
        "page_bytes": SPEC.page_bytes,
        "layout": LAYOUT.value,
        "objects_per_page": 2 * SPEC.num_kv_heads,
        "pages": pages,
    }


def _backend(directory: str, verify: bool, io_threads: int, pool: HostPool) -> FileBackend:
    """A file backend on `directory` with the pool registered (close it: a context manager)."""
    target = StorageTarget(_NAMESPACE, HeadRange.all_of(SPEC.num_kv_heads))
    backend = FileBackend(FileOptions(root_dir=directory, verify_checksums=verify), target,
                          io_threads)
    try:
        backend.register_pool(KV_POOL, pool)
    except BaseException:
        backend.close()
        raise
    return backend


def _ops(side: str, kv: FileBackend, keys: list[str]) -> dict[str, Callable[[range], None]]:
    return {f"{side}_w": lambda c: _check(kv.set_from(KV_POOL, [keys[p] for p in c], [*c])),
            f"{side}_r": lambda c: _check(kv.get_into(KV_POOL, [keys[p] for p in c], [*c]))}


def _count_calls(kv: FileBackend, keys: list[str], chunks: list[range],
                 objects: int) -> BatchShape:
    """The `os` I/O calls of one write and one read of every page into an empty root, as timed
    (CHUNK_PAGES pages a call), from every thread."""
    ops = _ops("kv", kv, keys)
    with _OsCalls() as calls:
        for chunk in chunks:
            ops["kv_w"](chunk)
        written = calls.count
        for chunk in chunks:
            ops["kv_r"](chunk)
    return BatchShape(objects, object_bytes(PART_BYTES), written, calls.count - written)


class _OsCalls:
    """Counts the calls of `os`'s I/O functions (_OS_IO) made by any thread inside its
    `with` block; they are wrapped meanwhile, so nothing timed runs inside one."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()
        self._real = {name: getattr(os, name) for name in _OS_IO}

    def __enter__(self) -> "_OsCalls":
        for name, fn in self._real.items():
            setattr(os, name, self._counted(fn))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self._real.items():
            setattr(os, name, fn)

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kw: Any) -> Any:
            with self._lock:
                self.count += 1
            return fn(*args, **kw)
        return call


class _RawFiles:
    """The baseline: one plain file per object (KV head and part), written and read with
    open().

    Paths and page views are made up front so the timed loops hold nothing but file I/O.
    """

    def __init__(self, directory: str, pool: HostPool) -> None:
        heads = range(pool.spec.num_kv_heads)
        self.parts = [[(os.path.join(directory, f"{page}_{head}_{part}"),
                        pool.page_head_view(page, head, part).numpy())
                       for head in heads for part in (0, 1)]
                      for page in range(pool.num_pages)]

    def write(self, pages: range) -> None:
        for page in pages:
            for path, data in self.parts[page]:
                with open(path, "wb") as f:
                    f.write(data)

    def read(self, pages: range) -> None:
        for page in pages:
            for path, data in self.parts[page]:
                with open(path, "rb") as f:
                    f.readinto(data)


def _check(result: TransferResult) -> None:
    if not all(result.ok):
        raise KvtierError(f"file backend bench: {result.ok.count(False)} pages failed; see the log")


def _check_exists(backend: FileBackend, probe: list[str]) -> None:
    if backend.exists(probe).usable_pages != len(probe):
        raise KvtierError("file backend bench: written pages are not all present")


def _fresh(path: str) -> None:
    """An empty directory, with earlier runs' dirty pages flushed so each side starts even."""
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path, mode=0o700)
    os.sync()
