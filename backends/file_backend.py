"""The embedded default L3: one file per page part under `root_dir/<object_name>`.

Reads and writes go straight between the registered host pool and the page cache (readv /
writev on the pool's memory, no intermediate bytes); every object carries its own name and
an xxh3 checksum (file_object), so torn, foreign or rotten files are misses that get removed
(rotten ones only while `verify_checksums` is on, the default: off, reads skip the xxh3).
Several processes may share one root: objects appear atomically and are never replaced.
With `max_size_bytes` the backend evicts whole pages, least recently used first: the root,
its LRU index and the bound are file_store's, shared with the nixl backend.

Why a few I/O threads: `os.readv`/`os.writev` and xxh3 release the GIL, so while one page's
bytes are being checksummed another's are being copied by the kernel. The calling thread
alone touches the index and the counters; workers only move bytes and report outcomes.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Callable, TypeVar

from kvtier.backends.base import (Capabilities, PoolRegistration, StorageBackend, StorageTarget,
                                  TransferResult)
from kvtier.backends.file_object import (ReadOutcome, ReadStatus, WriteOutcome, WriteStatus,
                                         object_bytes, read_object, write_object)
from kvtier.backends.file_pool import PoolFiles
from kvtier.backends.file_store import FileStore, is_file
from kvtier.errors import ConfigError
from kvtier.policies import HitPolicy, StorageBackendKind
from kvtier.storage_options import FileOptions

log = logging.getLogger(__name__)

DEFAULT_IO_THREADS = 2  # overlap one page's checksum with another's copy; 1 = no threads
_Job = tuple[list[str], list[str], list[memoryview]]  # names, paths, page views of one page
_T = TypeVar("_T")


class FileBackend(StorageBackend):
    kind = StorageBackendKind.FILE
    capabilities = Capabilities(zero_copy=True, shared=True, persistent=True, verified=True,
                                bounded=True, listable=True)

    def __init__(self, options: FileOptions, target: StorageTarget,
                 io_threads: int = DEFAULT_IO_THREADS) -> None:
        super().__init__(target)
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ConfigError(f"file backend: io_threads must be an int >= 1, got {io_threads!r}")
        self.options = options
        self.capabilities = dataclasses.replace(type(self).capabilities,
                                                verified=options.verify_checksums)
        # the root, its LRU index and the byte bound; StorageUnavailable here, at attach
        self.store = FileStore(options.root_dir, options.max_size_bytes, self.counters,
                               total_heads=target.heads.total)
        self.root, self.index = self.store.root, self.store.index
        self._files: dict[str, PoolFiles] = {}
        self._io_threads = io_threads
        self._workers: ThreadPoolExecutor | None = None
        self._workers_pid = 0  # threads do not survive fork: a forked child starts its own

    # ---- the interface -------------------------------------------------------------------
    def _register(self, reg: PoolRegistration) -> None:
        self._files[reg.name] = PoolFiles(self.root.path, self.target, reg)

    def names(self, reg: PoolRegistration, key: str) -> list[str]:
        return self._files[reg.name].names(key)

    def _present(self, reg: PoolRegistration, keys: list[str]) -> list[bool]:
        # ALL_PAGES only counts leading pages: after the first gap the rest cannot matter.
        return self.store.present(self._files[reg.name], keys,
                                  reg.hit_policy is HitPolicy.ALL_PAGES)

    def _get(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]) -> TransferResult:
        pf = self._files[reg.name]
        if not self.root.inside(pf.rel_dir):
            return TransferResult([False] * len(keys), 0)
        jobs = [(pf.names(k), pf.paths(k), [pf.view(p, i) for i in range(len(pf.suffixes))])
                for k, p in zip(keys, host_pages)]
        ok = [self._note_reads(names, outcomes)
              for (names, _, _), outcomes in zip(jobs, self._map(self._read_page, jobs))]
        self.store.sync_stored()
        return TransferResult(ok, sum(ok) * len(pf.suffixes) * pf.part_bytes)

    def _set(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]) -> TransferResult:
        pf = self._files[reg.name]
        ok = [False] * len(keys)
        if not self.root.inside(pf.rel_dir) or not self.root.ensure_dir(pf.rel_dir):
            return TransferResult(ok, 0)
        jobs, where = self._plan_writes(pf, keys, host_pages, ok)
        size = object_bytes(pf.part_bytes)
        jobs = jobs[:self.store.admit([len(j[0]) * size for j in jobs],
                                      frozenset(n for k in keys for n in pf.names(k)))]
        results = self._map(self._write_page, jobs)
        retry = [n for n, res in enumerate(results) if res[-1].status is WriteStatus.NO_DIR]
        if retry:  # the directory vanished under us: create it again, write those pages again
            self.root.forget_dir(pf.rel_dir)
            if self.root.ensure_dir(pf.rel_dir):
                for n in retry:
                    results[n] = self._write_page(jobs[n])
        moved = 0
        for i, job, outcomes in zip(where, jobs, results):
            ok[i], nbytes = self._note_writes(job, outcomes)
            moved += nbytes
        self.store.sync_stored()
        return TransferResult(ok, moved)

    def _delete(self, reg: PoolRegistration, keys: list[str]) -> int:
        removed = self.store.delete(self.names(reg, key) for key in keys)
        self.store.sync_stored()
        return removed

    def _list_pages(self, pool: str, num_parts: int) -> dict[str, set[int]]:
        return self.store.list_pages(f"{self.target.namespace.name}/{pool}", num_parts)

    def _reclaim_old_format(self, pool: str) -> int:
        return self.store.reclaim_old_format(self.target.namespace, pool)

    def _close(self) -> None:
        """Stop the I/O threads and drop the pool views (files are closed after each call)."""
        if self._workers is not None and self._workers_pid == os.getpid():
            self._workers.shutdown(wait=True)
        self._workers = None
        for pf in self._files.values():
            pf.close()

    # ---- per page: workers move bytes, the calling thread records outcomes ---------------
    def _plan_writes(self, pf: PoolFiles, keys: list[str], host_pages: list[int],
                     ok: list[bool]) -> tuple[list[_Job], list[int]]:
        """One job per page with missing parts; pages already complete are marked ok."""
        jobs, where = [], []
        for i, (key, page) in enumerate(zip(keys, host_pages)):
            names, paths = pf.names(key), pf.paths(key)
            missing = [j for j, path in enumerate(paths) if not is_file(path)]
            if not missing:  # a page's bytes never change: keep what is stored
                self.store.keep_existing(names, object_bytes(pf.part_bytes))
                ok[i] = True
                continue
            jobs.append(([names[j] for j in missing], [paths[j] for j in missing],
                         [pf.view(page, j) for j in missing]))
            where.append(i)
        return jobs, where

    def _read_page(self, job: _Job) -> list[ReadOutcome]:
        """Read every part of one page (worker thread); stops at the first part that fails."""
        out = []
        for name, path, view in zip(*job):
            out.append(read_object(path, name.encode(), view, self.options.verify_checksums))
            if out[-1].status is not ReadStatus.OK:
                break
        return out

    def _write_page(self, job: _Job) -> list[WriteOutcome]:
        out = []
        for name, path, view in zip(*job):
            out.append(write_object(path, name.encode(), view, self.options.fsync))
            if out[-1].status in (WriteStatus.FAILED, WriteStatus.NO_DIR):
                break
        return out

    def _note_writes(self, job: _Job, outcomes: list[WriteOutcome]) -> tuple[bool, int]:
        moved = 0
        for name, view, outcome in zip(job[0], job[2], outcomes):
            if outcome.status in (WriteStatus.WRITTEN, WriteStatus.EXISTED):
                self.index.add(name, outcome.file_bytes)
                moved += len(view) if outcome.status is WriteStatus.WRITTEN else 0
            else:
                log.warning("file backend: cannot store %s (%s)", name, outcome.reason)
                return False, moved
        return len(outcomes) == len(job[0]), moved

    def _note_reads(self, names: list[str], outcomes: list[ReadOutcome]) -> bool:
        """Record one page's read outcomes; True when every part read and verified."""
        for name, outcome in zip(names, outcomes):
            if outcome.status is ReadStatus.OK:
                self.index.add(name, outcome.file_bytes)  # known or learned; now most recent
            elif outcome.status is ReadStatus.CORRUPT:
                self.counters.corrupt_objects += 1
                self.index.discard(name)
                log.warning("file backend: removed bad object %s (%s)", name, outcome.reason)
            elif outcome.status is ReadStatus.ERROR:
                log.warning("file backend: cannot read %s (%s); a miss", name, outcome.reason)
        # _read_page stops at the first bad part: all good iff all there and the last is OK
        return len(outcomes) == len(names) and outcomes[-1].status is ReadStatus.OK

    def _map(self, fn: Callable[[_Job], _T], jobs: list[_Job]) -> list[_T]:
        """`fn` over the jobs, in order, split into one contiguous slice per I/O thread (the
        calling thread takes the first). Returns only when every slice has finished, so no
        worker touches the borrowed pages after the call, even when one of them raised.

        Why slices and not a task per page: one hand-off per thread per batch, and each
        thread hashes what it just read while it is still in its own cache.
        """
        n = min(self._io_threads, len(jobs))
        if n < 2:
            return [fn(job) for job in jobs]
        if self._workers is None or self._workers_pid != os.getpid():
            self._workers = ThreadPoolExecutor(self._io_threads - 1,
                                               thread_name_prefix="kvtier-file")
            self._workers_pid = os.getpid()
        bounds = [len(jobs) * i // n for i in range(n + 1)]
        slices = [jobs[a:b] for a, b in zip(bounds, bounds[1:])]
        futures = [self._workers.submit(_run_all, fn, part) for part in slices[1:]]
        try:
            first = _run_all(fn, slices[0])
        finally:
            wait(futures)
        return first + [r for f in futures for r in f.result()]


def _run_all(fn: Callable[[_Job], _T], jobs: list[_Job]) -> list[_T]:
    return [fn(job) for job in jobs]
