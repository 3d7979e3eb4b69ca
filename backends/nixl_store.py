"""The storage root as the nixl backend keeps it: directories, the LRU index, the byte bound.

The rules are the file backend's, built from its index (file_index): objects found by a
scan at attach (so a restart keeps them), least recently used first, and eviction of whole
pages (every part of every TP rank) until `max_size_bytes` holds. The index is this
process's view; files other processes add are learned when touched or at the next scan.
"""
from __future__ import annotations

import logging
import os
import stat

from kvtier.backends.base import BackendStats, StorageUnavailable
from kvtier.backends.file_index import ObjectIndex, page_siblings
from kvtier.errors import CacheUsageError

log = logging.getLogger(__name__)

DIR_MODE = 0o700  # a tenant's KV: readable by the serving user only (as the file backend)


class ObjectStore:
    """`root_dir` with its object index; evicts to keep `max_size_bytes` (0 = unbounded)."""

    def __init__(self, root_dir: str, max_size_bytes: int, counters: BackendStats) -> None:
        self.root = attach_root(root_dir)
        self.max_size_bytes = max_size_bytes
        self.counters = counters
        self._ready_dirs: set[str] = set()  # relative dirs that exist and stay inside root
        self._warned: set[str] = set()
        self.index, report = ObjectIndex.scan(self.root)
        counters.extra.update(root_dir=self.root, scan_objects=report.objects)
        log.info("nixl backend at %s: %d objects, %.1f MiB", self.root, report.objects,
                 report.stored_bytes / 2**20)
        self.make_room(0, frozenset())

    # ---- capacity ------------------------------------------------------------------------
    def admit(self, incoming: list[int], protect: frozenset[str]) -> int:
        """How many leading page writes fit the bound, after evicting room for them."""
        cap, total, n = self.max_size_bytes, 0, 0
        while n < len(incoming) and (not cap or total + incoming[n] <= cap):
            total, n = total + incoming[n], n + 1
        if n < len(incoming):
            self.warn_once("cap", "nixl backend: %d of %d page writes exceed max_size_bytes=%d "
                           "and are dropped: raise max_size_bytes", len(incoming) - n,
                           len(incoming), cap)
        self.make_room(total, protect)
        return n

    def make_room(self, incoming: int, protect: frozenset[str]) -> None:
        """Evict least recently used pages until `incoming` more bytes fit; never a page
        that has an object in `protect` (the call that is writing or keeping it)."""
        cap = self.max_size_bytes
        spins = len(self.index)  # each protected object is passed over at most once
        while cap and self.index.total_bytes + incoming > cap and spins >= 0:
            name = self.index.oldest()
            if name is None:
                break  # what is left belongs to processes we do not know of
            siblings = page_siblings(name)
            if protect.intersection(siblings):
                self.index.touch(name)
                spins -= 1
                continue
            for sibling in siblings:
                self.unlink(sibling)
            self.counters.evicted_pages += 1
        self.counters.stored_bytes = self.index.total_bytes

    def unlink(self, name: str) -> bool:
        """Remove one object file if present; True when it was there."""
        self.index.discard(name)
        try:
            os.unlink(object_path(self.root, name))
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            log.warning("nixl backend: cannot remove %s (%s)", name, exc.strerror or exc)
            return False

    # ---- directories ---------------------------------------------------------------------
    def dir_ok(self, rel_dir: str) -> bool:
        """Does `root/rel_dir` stay inside root (no symlink out)? Checked until it exists,
        then trusted: kvtier created it (mode 0700)."""
        if rel_dir in self._ready_dirs:
            return True
        path = object_path(self.root, rel_dir)
        if os.path.realpath(path) != path:
            self.warn_once(rel_dir, "nixl backend: %s resolves outside %s (a symlink?); its "
                           "objects are treated as missing: remove the link", path, self.root)
            return False
        if os.path.isdir(path):
            self._ready_dirs.add(rel_dir)
        return True

    def ensure_dir(self, rel_dir: str) -> bool:
        """Create `root/rel_dir` (mode 0700) once; False when that is impossible."""
        if rel_dir in self._ready_dirs:
            return True
        path = object_path(self.root, rel_dir)
        try:
            os.makedirs(path, DIR_MODE, exist_ok=True)
        except OSError as exc:
            self.warn_once(rel_dir, "nixl backend: cannot create %s (%s)", path, exc.strerror or exc)
            return False
        if os.path.realpath(path) != path:
            self.warn_once(rel_dir, "nixl backend: %s leads outside %s", path, self.root)
            return False
        self._ready_dirs.add(rel_dir)
        return True

    def forget_dir(self, rel_dir: str) -> None:
        """A write found the directory gone (an operator, a cleanup): check it again next time."""
        self._ready_dirs.discard(rel_dir)

    def warn_once(self, topic: str, msg: str, *args: object) -> None:
        if topic not in self._warned:
            self._warned.add(topic)
            log.warning(msg, *args)


def attach_root(root_dir: str) -> str:
    """Create (0700) and probe `root_dir`; its real path, or StorageUnavailable saying why."""
    try:
        os.makedirs(root_dir, DIR_MODE, exist_ok=True)
        root = os.path.realpath(root_dir)
        probe = os.path.join(root, f".kvtier-probe-{os.getpid()}")
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
        os.unlink(probe)
    except OSError as exc:
        raise StorageUnavailable(
            f"nixl backend: root_dir {root_dir!r} cannot be used ({exc.strerror or exc}); point "
            "storage_options root_dir at a writable directory (or fix its permissions, or "
            "remove the file in its way)") from exc
    return root


def object_path(root: str, name: str) -> str:
    """`root/name`, refusing names that could leave root (the second fence after
    StorageTarget.object_name, which builds names from validated parts only)."""
    parts = name.split("/")
    if name.startswith("/") or "\x00" in name or any(p in ("", ".", "..") for p in parts):
        raise CacheUsageError(f"object name {name!r:.120} would leave root_dir {root}")
    return os.path.join(root, name)


def is_file(path: str) -> bool:
    """Cheap presence check (one lstat, no read): a regular file under the object name."""
    try:
        return stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode)
    except OSError:
        return False
