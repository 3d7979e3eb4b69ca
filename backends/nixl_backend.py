"""The `nixl` L3 backend: the file backend's objects, moved by NIXL's POSIX plugin.

Pages are stored exactly as the `file` backend stores them, through its public pieces:
names, paths and page views (file_pool.PoolFiles), the header and checksum format
(file_object via nixl_object), and the root, its LRU index and byte bound (file_store's
FileStore, the very class the file backend uses). One root_dir serves either backend. What differs is the data path:
- the host pool is registered with NIXL once (`register_pool`);
- each `get_into` / `set_from` batch is ONE NIXL request over zero-copy descriptors
  (pool page part <-> file payload range), instead of one read/write per object;
- what NIXL does not do is done around it: headers are checked before a read is posted,
  every payload is verified (xxh3 over the host page) after it lands (unless
  `verify_checksums` is off: writes store the checksum either way), and written files
  get their names (atomic link, never replacing) only after the request succeeded.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import resource
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, NamedTuple

import numpy as np
import xxhash

from kvtier.backends.base import (Capabilities, PoolRegistration, StorageBackend, StorageTarget,
                                  StorageUnavailable, TransferResult)
from kvtier.backends.file_pool import PoolFiles
from kvtier.backends.file_store import FileStore, is_file
from kvtier.backends.nixl_agent import PosixAgent, TransferTimeout
from kvtier.backends.nixl_object import (HEADER_BYTES, TempFiles, check_header, encode_header,
                                         object_bytes)
from kvtier.errors import CacheUsageError
from kvtier.policies import HitPolicy, StorageBackendKind
from kvtier.storage_options import NixlOptions, NixlPlugin

log = logging.getLogger(__name__)

_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _objects_per_transfer() -> int:
    """Objects (open files) one NIXL request may hold: 2,048, and at most half the process's
    open-file limit. Larger calls split into whole requests, one after another (each costs a
    round of NIXL's fixed overhead, so fewer is faster)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2048 if soft < 0 else max(64, min(2048, soft // 2))


MAX_OBJECTS_PER_TRANSFER = _objects_per_transfer()
PARALLEL_HASH_BYTES = 8 << 20  # below this, threads cost more than they save
HASH_THREADS = 2  # xxh3 releases the GIL; more threads than cores only contend


class _Part(NamedTuple):
    """One object file taking part in a NIXL request."""

    slot: int  # index of its page in the batch
    name: str
    path: str
    fd: int
    view: np.ndarray  # the host pool's bytes of this part (a view, never a copy)
    checksum: int = 0  # read: the stored checksum (writes compute theirs)
    tmp: str = ""  # write: a named temp file to unlink afterwards ("" when unnamed)


class NixlBackend(StorageBackend):
    kind = StorageBackendKind.NIXL
    capabilities = Capabilities(zero_copy=True, shared=True, persistent=True, verified=True,
                                bounded=True, listable=True)
    # A request may take timeout_base_s + bytes / timeout_min_bytes_per_s before the
    # backend gives up on the storage (a hung disk must not hang the cache forever).
    timeout_base_s = 10.0
    timeout_min_bytes_per_s = 50e6

    def __init__(self, options: NixlOptions, target: StorageTarget) -> None:
        super().__init__(target)
        if options.plugin is not NixlPlugin.POSIX:
            raise StorageUnavailable(
                "the nixl storage backend keeps pages in files through NIXL's POSIX plugin; "
                f"plugin {options.plugin} is not supported here: set storage_options plugin "
                "to POSIX (or leave it out)")
        self.options = options
        self.capabilities = dataclasses.replace(type(self).capabilities,
                                                verified=options.verify_checksums)
        self.store = FileStore(options.root_dir, options.max_size_bytes, self.counters,
                               label="nixl backend", total_heads=target.heads.total)
        self.root, self.index = self.store.root.path, self.store.index
        self._files: dict[str, PoolFiles] = {}
        self.agent = PosixAgent()
        self._temps = TempFiles(self.root)
        self._hasher: ThreadPoolExecutor | None = None
        self._broken = ""  # why the storage stopped answering, once it has

    # ---- the interface -------------------------------------------------------------------
    def _register(self, reg: PoolRegistration) -> None:
        pf = PoolFiles(self.root, self.target, reg)  # checks: page parts are contiguous bytes
        start, end = reg.pool.data_ptr(), reg.pool.data_ptr() + reg.pool.nbytes
        for page, part in ((0, 0), (reg.pool.num_pages - 1, len(reg.slots) - 1)):
            addr = np.asarray(pf.view(page, part)).ctypes.data
            if not start <= addr <= addr + pf.part_bytes <= end:
                raise CacheUsageError(f"pool {reg.name!r}: page {page} lies outside data_ptr().."
                                      "+nbytes; register the pool object that owns the memory")
        self.agent.register_dram(start, reg.pool.nbytes)
        self._files[reg.name] = pf

    def names(self, reg: PoolRegistration, key: str) -> list[str]:
        return self._files[reg.name].names(key)

    def _present(self, reg: PoolRegistration, keys: list[str]) -> list[bool]:
        self._check_usable()
        return self.store.present(self._files[reg.name], keys,  # ALL_PAGES: later pages
                                  reg.hit_policy is HitPolicy.ALL_PAGES)  # cannot count

    def _get(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]) -> TransferResult:
        return self._batched(self._get_batch, reg, keys, host_pages)

    def _set(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]) -> TransferResult:
        result = self._batched(self._set_batch, reg, keys, host_pages)
        self.store.make_room(0, frozenset())  # a batch may end past the bound: trim the oldest
        return result

    def _delete(self, reg: PoolRegistration, keys: list[str]) -> int:
        self._check_usable()
        removed = self.store.delete(self.names(reg, key) for key in keys)
        self.store.make_room(0, frozenset())  # updates stored_bytes
        return removed

    def _list_pages(self, pool: str, num_parts: int) -> dict[str, set[int]]:
        return self.store.list_pages(f"{self.target.namespace.name}/{pool}", num_parts)

    def _reclaim_old_format(self, pool: str) -> int:
        return self.store.reclaim_old_format(self.target.namespace, pool)

    def _close(self) -> None:
        self.agent.close()
        self._temps.close()
        if self._hasher is not None:
            self._hasher.shutdown(wait=True)
        for pf in self._files.values():
            pf.close()

    def _batched(self, fn: Callable[..., TransferResult], reg: PoolRegistration,
                 keys: list[str], pages: list[int]) -> TransferResult:
        self._check_usable()
        pf, ok, moved = self._files[reg.name], [], 0
        step = max(1, MAX_OBJECTS_PER_TRANSFER // len(reg.slots))
        for at in range(0, len(keys), step):
            some_keys, some_pages = keys[at:at + step], pages[at:at + step]
            if self.store.root.inside(pf.rel_dir):
                res = fn(pf, some_keys, some_pages)
            else:  # the pool's directory leads out of root: nothing there is ours
                res = TransferResult([False] * len(some_keys), 0)
            ok, moved = ok + res.ok, moved + res.bytes_moved
        self.store.sync_stored()
        return TransferResult(ok, moved)

    # ---- reads ---------------------------------------------------------------------------
    def _get_batch(self, pf: PoolFiles, keys: list[str], pages: list[int]) -> TransferResult:
        ok, parts = [False] * len(keys), []
        try:
            for slot, (key, page) in enumerate(zip(keys, pages)):
                parts += self._open_page(pf, key, page, slot)
            if not parts or not self._move("READ", parts):
                return TransferResult(ok, 0)
            bad: set[int] = set()
            if self.options.verify_checksums:
                sums = self._checksums([p.view for p in parts])()
                for p, s in zip(parts, sums):
                    if s != p.checksum:
                        bad.add(p.slot)
                        self._drop_bad(p.name, p.path, p.fd, "checksum mismatch")
            for p in parts:
                if p.slot not in bad:
                    ok[p.slot] = True
                    self.index.add(p.name, object_bytes(p.view.nbytes))  # now most recent
            return TransferResult(ok, sum(p.view.nbytes for p in parts if p.slot not in bad))
        finally:
            for p in parts:
                os.close(p.fd)

    def _open_page(self, pf: PoolFiles, key: str, page: int, slot: int) -> list[_Part]:
        """Open and check every part of one page: all of them, or [] (a miss)."""
        parts: list[_Part] = []
        for part, (name, path) in enumerate(zip(pf.names(key), pf.paths(key))):
            found = self._open_part(name, path, np.asarray(pf.view(page, part)), slot)
            if found is None:
                for p in parts:
                    os.close(p.fd)
                return []
            parts.append(found)
        return parts

    def _open_part(self, name: str, path: str, view: np.ndarray, slot: int) -> _Part | None:
        try:
            fd = os.open(path, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if os.path.islink(path):  # a symlink under an object name: never follow it
                self._drop_bad(name, path, None, "symlink under an object name")
            else:
                log.warning("nixl backend: cannot open %s (%s); a miss", name, exc.strerror or exc)
            return None
        try:
            size = os.fstat(fd).st_size
            checksum, problem = check_header(os.pread(fd, HEADER_BYTES, 0), name.encode(), view.nbytes)
        except OSError as exc:
            os.close(fd)
            log.warning("nixl backend: cannot read %s (%s); a miss", name, exc.strerror or exc)
            return None
        if not problem and size != object_bytes(view.nbytes):
            problem = f"file is {size} bytes, its header says {object_bytes(view.nbytes)}"
        if problem:
            self._drop_bad(name, path, fd, problem)
            os.close(fd)
            return None
        return _Part(slot, name, path, fd, view, checksum)

    def _drop_bad(self, name: str, path: str, fd: int | None, reason: str) -> None:
        """A torn, rotten or foreign object: count it and remove it (if it is still that file)."""
        self.counters.corrupt_objects += 1
        self.index.discard(name)
        log.warning("nixl backend: removed bad object %s (%s)", name, reason)
        try:
            if fd is not None:
                mine, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
                if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino):
                    return  # replaced meanwhile by a good copy from another writer
            os.unlink(path)
        except OSError:
            pass

    # ---- writes --------------------------------------------------------------------------
    def _set_batch(self, pf: PoolFiles, keys: list[str], pages: list[int]) -> TransferResult:
        ok, parts = [False] * len(keys), []
        if not self.store.root.ensure_dir(pf.rel_dir):
            return TransferResult(ok, 0)
        size = object_bytes(pf.part_bytes)
        todo: list[tuple[int, list[int]]] = []  # (slot, missing parts)
        for slot, key in enumerate(keys):
            missing = [j for j, path in enumerate(pf.paths(key)) if not is_file(path)]
            if missing:
                todo.append((slot, missing))
                continue
            self.store.keep_existing(pf.names(key), size)  # a page's bytes never change
            ok[slot] = True
        protect = frozenset(n for k in keys for n in pf.names(k))
        todo = todo[:self.store.admit([len(m) * size for _, m in todo], protect)]
        try:
            for slot, missing in todo:
                parts += self._create_page(pf, keys[slot], pages[slot], slot, missing)
            if not parts:
                return TransferResult(ok, 0)
            sums = self._checksums([p.view for p in parts])  # hashes while NIXL writes
            if not self._move("WRITE", parts):
                return TransferResult(ok, 0)
            return self._publish(parts, sums(), ok)
        finally:
            for p in parts:
                _close_quietly(p.fd)
                _unlink_quietly(p.tmp)

    def _create_page(self, pf: PoolFiles, key: str, page: int, slot: int,
                     missing: list[int]) -> list[_Part]:
        """Unlinked (or hidden) files for the missing parts of one page, or [] on failure."""
        names, paths, parts = pf.names(key), pf.paths(key), []
        for j in missing:
            try:
                fd, tmp = self._temps.create(paths[j])
            except OSError as exc:
                self.store.root.forget_dir(pf.rel_dir)  # gone? re-create it next call
                log.warning("nixl backend: cannot create %s (%s)", names[j], exc.strerror or exc)
                for p in parts:
                    _close_quietly(p.fd)
                    _unlink_quietly(p.tmp)
                return []
            parts.append(_Part(slot, names[j], paths[j], fd, np.asarray(pf.view(page, j)), 0, tmp))
        return parts

    def _publish(self, parts: list[_Part], sums: list[int], ok: list[bool]) -> TransferResult:
        """Write each header, then name each file (atomic link, never replacing another)."""
        failed: set[int] = set()
        moved = 0
        for p, checksum in zip(parts, sums):
            header = encode_header(p.name.encode(), p.view.nbytes, checksum)
            try:
                if os.pwrite(p.fd, header, 0) != len(header):
                    raise OSError("short header write")
                self._temps.link(p.fd, p.tmp, p.path)
                moved += p.view.nbytes
            except FileExistsError:
                pass  # another writer stored the same page first: the same bytes
            except OSError as exc:
                failed.add(p.slot)
                log.warning("nixl backend: cannot store %s (%s)", p.name, exc.strerror or exc)
                continue
            self.index.add(p.name, object_bytes(p.view.nbytes))
        for p in parts:
            ok[p.slot] = p.slot not in failed
        return TransferResult(ok, moved)

    # ---- NIXL and checksums --------------------------------------------------------------
    def _move(self, op: str, parts: list[_Part]) -> bool:
        """One NIXL request for every part; False when NIXL reports a failure."""
        nbytes = sum(p.view.nbytes for p in parts)
        mem = [(p.view.ctypes.data, p.view.nbytes) for p in parts]
        files = [(p.fd, HEADER_BYTES, p.view.nbytes) for p in parts]
        try:
            return self.agent.transfer(op, mem, files,
                                       self.timeout_base_s + nbytes / self.timeout_min_bytes_per_s)
        except TransferTimeout as exc:
            self._broken = str(exc)
            raise

    def _checksums(self, views: list[np.ndarray]) -> Callable[[], list[int]]:
        """Start hashing `views`; call the result for the xxh3_64 of each, in order.

        xxhash releases the GIL: large batches hash on HASH_THREADS threads, and a write
        hashes while NIXL moves the same (read-only) bytes.
        """
        if sum(v.nbytes for v in views) < PARALLEL_HASH_BYTES:
            return lambda: _hash_all(views)
        if self._hasher is None:
            self._hasher = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvtier-xxh3")
        step = -(-len(views) // HASH_THREADS)
        futures = [self._hasher.submit(_hash_all, views[i:i + step])
                   for i in range(0, len(views), step)]
        return lambda: [h for f in futures for h in f.result()]

    def _check_usable(self) -> None:
        if self._broken:
            raise StorageUnavailable(f"nixl backend disabled after a hung transfer: {self._broken}")


def _hash_all(views: list[np.ndarray]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(v) for v in views]


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _unlink_quietly(path: str) -> None:
    if path:
        try:
            os.unlink(path)
        except OSError:
            pass
