"""The `nixl` L3 backend: the file backend's objects, moved by NIXL's POSIX plugin.

Pages are stored exactly as the `file` backend stores them, through its public pieces:
names, paths and page views (file_pool.PoolFiles), the header and checksum format
(file_object via nixl_object), and the root, its LRU index and byte bound (file_store's
FileStore, the very class the file backend uses). One root_dir serves either backend.
What differs is the data path:
- the host pool is registered with NIXL once (`register_pool`);
- a `set_from` batch is ONE NIXL request over zero-copy descriptors (pool page part <->
  file payload range), a `get_into` batch one request per READ_CHUNK_BYTES of whole pages
  (below), instead of one read/write per object;
- what NIXL does not do is done around it: headers (and file sizes) are checked before a
  read is posted, every payload is verified (xxh3 over the host page) after it lands
  (unless `verify_checksums` is off: writes store the checksum either way), and written
  files get their names (atomic link, never replacing) only after the request succeeded.

Why reads are a pipeline. NIXL's POSIX plugin (Linux AIO on page-cache files) copies in
the thread that posts and polls the request, so that thread's core is busy for the whole
request, the other core idle; a read batch used to add, on the same thread, opening and
checking every object before the request (~13 ms for 256 SmolLM2 pages, 1,536 objects)
and hashing every payload after it (16-18 ms): 0.6x raw NIXL verified, 0.7-0.8x without.
Now the batch moves in chunks of whole pages: while NIXL moves chunk k on the calling
thread, one helper thread verifies chunk k-1 (xxh3 releases the GIL), records its hits,
closes its files, then opens and checks chunk k+1 and builds its descriptors. The calling
thread opens the first chunk and verifies the last (on its own core, still in cache).
Measured here (2 cores, 256 pages, page-cache hot, medians of 12 interleaved runs, read
speed over raw NIXL's, verified / unverified):
- chunk size: hashing is cheap only while the chunk just copied is still in cache; hashing
  cold pages beside NIXL's copy slows the copy by about the hash's own time (memory
  bandwidth). 8 MiB chunks: 0.98x / 1.01x; 16 MiB 0.85x / 0.99x; 64 MiB 0.84x / 0.97x;
  4 MiB 0.88x / 0.87x; 2 MiB (here one page per request) 0.62x / 0.67x: each request's
  NIXL setup and thread hand-off (~0.1 ms) outweigh what they hide.
- verifying each chunk on the calling thread right after it lands (cache-hot, ~7 ms in
  all, nothing overlapped): 0.74x, against 0.87x on the helper in the same run.
- whatever per object can leave the calling thread does (index updates, closes, the
  descriptor arrays): that thread is the critical path, while the helper has time to spare
  (opening and checking ~10 us per object, hashing ~8 us, against NIXL's ~25 us).
Not done: reading the headers inside the NIXL request (into a scratch buffer) would put
1,536 more I/Os on the critical path to save the helper's preads, which cost it nothing;
letting this thread open what the helper has not reached yet instead of waiting for it (a
work queue both threads take pages from) measured no better in the bench (4 runs each:
0.80-0.88x verified, against 0.81-0.91x); a non-blocking start/wait in PosixAgent is not
needed, as the calling thread's wait IS the copy (so `PosixAgent.transfer` stays the one
call per request, as the bench counts it). Small batches (one chunk) run as before, on the
calling thread alone. The overlap needs the second core: where another process keeps it
busy, the helper's work waits for it and the gain shrinks.

Threads: the helper runs only while the calling thread is inside a NIXL request, which
touches neither the index nor the counters, and the calling thread waits for it before it
does anything else: the batch's state is handed over between the two, never shared.
"""
from __future__ import annotations

import ctypes
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
    """Objects (open files) one batch may hold: 2,048, and at most half the process's
    open-file limit. Larger calls split into whole batches, one after another. A write batch
    is one NIXL request (each costs a round of NIXL's fixed overhead, so fewer is faster); a
    read batch holds at most three of its chunks open at a time (module docstring)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2048 if soft < 0 else max(64, min(2048, soft // 2))


MAX_OBJECTS_PER_TRANSFER = _objects_per_transfer()
READ_CHUNK_BYTES = 8 << 20  # pages per read request: this many bytes, >= 1 (module docstring)
PARALLEL_HASH_BYTES = 8 << 20  # below this, threads cost more than they save
HASH_THREADS = 2  # xxh3 releases the GIL; more threads than cores only contend


class _Part(NamedTuple):
    """One object file taking part in a NIXL request."""

    slot: int  # index of its page in the batch
    name: str
    path: str
    fd: int
    view: memoryview  # the host pool's bytes of this part (a view, never a copy)
    addr: int  # where `view` starts
    checksum: int = 0  # read: the stored checksum (writes compute theirs)
    tmp: str = ""  # write: a named temp file to unlink afterwards ("" when unnamed)


class _Chunk(NamedTuple):
    """Some pages of a read batch, opened and checked, with their NIXL descriptors."""

    parts: list[_Part]
    mem: np.ndarray  # per part: (address, bytes)
    files: np.ndarray  # per part: (fd, file offset, bytes)


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
        self._helpers: ThreadPoolExecutor | None = None  # hashing and read-ahead threads
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
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)
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
        """Read a batch as a pipeline of NIXL requests (module docstring): while NIXL moves
        chunk k on this thread, a helper thread finishes chunk k-1 and opens chunk k+1."""
        ok, verify = [False] * len(keys), self.options.verify_checksums
        per = max(1, READ_CHUNK_BYTES // (pf.part_bytes * len(pf.suffixes)))
        spans = [range(at, min(at + per, len(keys))) for at in range(0, len(keys), per)]
        moved, side = 0, None  # side: the helper's work while NIXL moves `now`
        prev: _Chunk | None = None  # moved last; then the helper's, to verify and close
        arrived = False  # whether NIXL moved `prev`
        now: _Chunk | None = self._open_chunk(pf, keys, pages, spans[0])  # moves next
        try:
            for k in range(len(spans)):
                todo = spans[k + 1] if k + 1 < len(spans) else None
                if prev is not None or todo is not None:
                    side = self._threads().submit(self._side_work, prev, arrived, ok,
                                                  pf, keys, pages, todo)
                    prev = None  # the helper closes it
                arrived = bool(now.parts) and self._move("READ", now.mem, now.files)
                got, ahead = side.result() if side is not None else (0, None)
                side = None
                moved += got
                prev, now = now, ahead
            if arrived:  # the last chunk: verified here, while its bytes are in cache
                sums = self._checksums([p.view for p in prev.parts])() if verify else None
                moved += self._accept(prev.parts, sums, ok)
            return TransferResult(ok, moved)
        finally:
            ahead = None
            if side is not None:  # a request raised (TransferTimeout): wait for the helper
                try:
                    ahead = side.result()[1]
                except Exception:  # noqa: BLE001 - it closed what it opened
                    pass
            for chunk in (prev, now, ahead):
                if chunk is not None:
                    _close_all(chunk.parts)

    def _side_work(self, prev: _Chunk | None, arrived: bool, ok: list[bool], pf: PoolFiles,
                   keys: list[str], pages: list[int],
                   todo: range | None) -> tuple[int, _Chunk | None]:
        """The helper thread's share while NIXL moves a chunk: the chunk before it verified
        (when it `arrived`), its hits recorded and its files closed; then the next chunk
        (`todo`) opened and checked. Returns the hits' bytes and the next chunk.

        It runs only while the calling thread is inside the NIXL request, which touches
        neither the index nor the counters: the state is handed over, never shared."""
        got = 0
        if prev is not None:
            try:
                if arrived:
                    sums = (_hash_all([p.view for p in prev.parts])
                            if self.options.verify_checksums else None)
                    got = self._accept(prev.parts, sums, ok)
            finally:
                _close_all(prev.parts)
        return got, (None if todo is None else self._open_chunk(pf, keys, pages, todo))

    def _accept(self, parts: list[_Part], sums: list[int] | None, ok: list[bool]) -> int:
        """Pages of `parts` (moved by NIXL) whose every part matches its stored checksum
        (all, with `sums` None: unverified) become hits; the others' bad objects go. Returns
        the payload bytes of the hits."""
        bad: set[int] = set()
        for p, s in zip(parts, sums or ()):
            if s != p.checksum:
                bad.add(p.slot)
                self._drop_bad(p.name, p.path, p.fd, "checksum mismatch")
        moved = 0
        for p in parts:
            if p.slot not in bad:
                ok[p.slot] = True
                self.index.add(p.name, object_bytes(p.view.nbytes))  # now most recent
                moved += p.view.nbytes
        return moved

    def _open_chunk(self, pf: PoolFiles, keys: list[str], pages: list[int],
                    slots: range) -> _Chunk:
        """Open and check every part of the pages `slots` (a page whose part is missing or
        bad opens none: a miss), with the NIXL descriptors of what opened."""
        parts: list[_Part] = []
        try:
            for slot in slots:
                page, key, first = pages[slot], keys[slot], len(parts)
                for part, (name, path) in enumerate(zip(pf.names(key), pf.paths(key))):
                    found = self._open_part(name, path, pf.view(page, part), slot)
                    if found is None:
                        _close_all(parts[first:])
                        del parts[first:]
                        break
                    parts.append(found)
            return _Chunk(parts, *_descs(parts))
        except BaseException:
            _close_all(parts)
            raise

    def _open_part(self, name: str, path: str, view: memoryview, slot: int) -> _Part | None:
        """One object opened with its header and size checked (open, pread, lseek), or None:
        absent, unreadable, or bad (then removed)."""
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
            block = os.pread(fd, HEADER_BYTES, 0)
            size = os.lseek(fd, 0, os.SEEK_END)  # a regular file's size, cheaper than fstat
        except OSError as exc:
            os.close(fd)
            log.warning("nixl backend: cannot read %s (%s); a miss", name, exc.strerror or exc)
            return None
        checksum, problem = check_header(block, name.encode(), view.nbytes)
        if not problem and size != object_bytes(view.nbytes):
            problem = f"file is {size} bytes, its header says {object_bytes(view.nbytes)}"
        if problem:
            self._drop_bad(name, path, fd, problem)
            os.close(fd)
            return None
        return _Part(slot, name, path, fd, view, _address(view), checksum)

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
            if not self._move("WRITE", *_descs(parts)):
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
            view = pf.view(page, j)
            parts.append(_Part(slot, names[j], paths[j], fd, view, _address(view), 0, tmp))
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
    def _move(self, op: str, mem: np.ndarray, files: np.ndarray) -> bool:
        """One NIXL request (descriptors from _descs); False when NIXL reports a failure."""
        nbytes = int(mem[:, 1].sum())
        try:
            return self.agent.transfer(op, mem, files,
                                       self.timeout_base_s + nbytes / self.timeout_min_bytes_per_s)
        except TransferTimeout as exc:
            self._broken = str(exc)
            raise

    def _checksums(self, views: list[memoryview]) -> Callable[[], list[int]]:
        """Start hashing `views`; call the result for the xxh3_64 of each, in order.

        xxhash releases the GIL: large batches hash on HASH_THREADS threads, and a write
        hashes while NIXL moves the same (read-only) bytes.
        """
        if sum(v.nbytes for v in views) < PARALLEL_HASH_BYTES:
            return lambda: _hash_all(views)
        step = -(-len(views) // HASH_THREADS)
        futures = [self._threads().submit(_hash_all, views[i:i + step])
                   for i in range(0, len(views), step)]
        return lambda: [h for f in futures for h in f.result()]

    def _threads(self) -> ThreadPoolExecutor:
        if self._helpers is None:
            self._helpers = ThreadPoolExecutor(HASH_THREADS, thread_name_prefix="kvtier-nixl")
        return self._helpers

    def _check_usable(self) -> None:
        if self._broken:
            raise StorageUnavailable(f"nixl backend disabled after a hung transfer: {self._broken}")


def _hash_all(views: list[memoryview]) -> list[int]:
    return [xxhash.xxh3_64_intdigest(v) for v in views]


def _descs(parts: list[_Part]) -> tuple[np.ndarray, np.ndarray]:
    """NIXL descriptors of `parts`: (address, bytes) of each in the pool, and (fd, offset,
    bytes) of its payload in its file."""
    mem = np.array([(p.addr, p.view.nbytes) for p in parts], dtype=np.uint64).reshape(-1, 2)
    files = np.array([(p.fd, HEADER_BYTES, p.view.nbytes) for p in parts],
                     dtype=np.uint64).reshape(-1, 3)
    return mem, files


def _close_all(parts: list[_Part]) -> None:
    for p in parts:
        _close_quietly(p.fd)


def _address(view: memoryview) -> int:
    """Where a (writable) pool view starts: ctypes, ~5x cheaper than numpy's .ctypes.data."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


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
