"""The L3 root as the file and nixl backends keep it: path fence, LRU index and byte bound.

Both backends store the same objects in the same layout (`root/<namespace>/<pool>/<name>`,
file_object's format), so one root_dir serves either; this class is the one owner of what
they keep about it:
- the root itself (file_root.FileRoot: created and probed at attach, every path fenced);
- the index (file_index.ObjectIndex): objects found by a scan at attach (so a restart keeps
  them), least recently used first, kept current by this process's reads, writes, deletes;
- the bound: with `max_size_bytes` (0 = unbounded) whole pages (every part of every KV head)
  are evicted, oldest first, never one a call is writing or keeping; leading writes that
  cannot fit are dropped, with one warning;
- the counters it drives: `evicted_pages` and `stored_bytes`.
The index is this process's view; files other processes add are learned when touched or at
the next scan. Only the calling thread touches the store (workers move bytes).
"""
from __future__ import annotations

import logging
import os
import stat
from typing import Iterable

from kvtier.backends.base import BackendStats
from kvtier.backends.object_names import old_format_pages, page_heads, same_model_namespace
from kvtier.backends.file_index import ObjectIndex, page_siblings
from kvtier.backends.file_pool import PoolFiles
from kvtier.backends.file_root import FileRoot
from kvtier.keys import KeyNamespace

log = logging.getLogger(__name__)


class FileStore:
    """`root_dir` with its object index; evicts to keep `max_size_bytes` (0 = unbounded)."""

    def __init__(self, root_dir: str, max_size_bytes: int, counters: BackendStats,
                 label: str = "file backend", total_heads: int = 1) -> None:
        self.label = label
        self.total_heads = total_heads  # a page's objects: every part of this many KV heads  # "file backend" / "nixl backend": who the log lines speak for
        self.root = FileRoot(root_dir, label)  # StorageUnavailable here, at attach
        self.max_size_bytes = max_size_bytes
        self.counters = counters
        self._cap_warned = False
        self.index, report = ObjectIndex.scan(self.root.path)
        counters.extra.update(root_dir=self.root.path, scan_objects=report.objects,
                              scan_s=round(report.seconds, 4))
        log.info("%s at %s: %d objects, %.1f MiB found in %.3f s (%d stale temp files removed)",
                 label, self.root.path, report.objects, report.stored_bytes / 2**20,
                 report.seconds, report.stale_tmp_removed)
        self.make_room(0, frozenset())

    # ---- capacity ------------------------------------------------------------------------
    def admit(self, incoming: list[int], protect: frozenset[str]) -> int:
        """How many leading page writes fit `max_size_bytes`, after evicting room for them."""
        cap, total, n = self.max_size_bytes, 0, 0
        while n < len(incoming) and (not cap or total + incoming[n] <= cap):
            total, n = total + incoming[n], n + 1
        if n < len(incoming) and not self._cap_warned:
            self._cap_warned = True
            log.warning("%s: %d of %d page writes exceed max_size_bytes=%d and are dropped: "
                        "raise max_size_bytes", self.label, len(incoming) - n, len(incoming), cap)
        self.make_room(total, protect)
        return n

    def make_room(self, incoming: int, protect: frozenset[str]) -> None:
        """Evict least recently used pages (all parts, all ranks) until `incoming` more bytes
        fit; never a page that has an object in `protect` (the call writing or keeping it)."""
        cap = self.max_size_bytes
        spins = len(self.index)  # each protected object is passed over at most once
        while cap and self.index.total_bytes + incoming > cap and spins >= 0:
            name = self.index.oldest()
            if name is None:
                break  # what is left belongs to processes we do not know of
            siblings = page_siblings(name, self.total_heads)
            if protect.intersection(siblings):
                self.index.touch(name)
                spins -= 1
                continue
            for sibling in siblings:
                self.unlink(sibling)
            self.counters.evicted_pages += 1
        self.sync_stored()

    def sync_stored(self) -> None:
        self.counters.stored_bytes = self.index.total_bytes

    # ---- objects -------------------------------------------------------------------------
    def unlink(self, name: str) -> bool:
        """Remove one object file if present; True when it was there."""
        self.index.discard(name)
        path = self.root.object_path(name)
        if path is None:
            return False
        try:
            os.unlink(path)
            return True
        except (FileNotFoundError, NotADirectoryError):
            return False
        except OSError as exc:
            log.warning("%s: cannot remove %s (%s)", self.label, name, exc.strerror or exc)
            return False

    def delete(self, pages: Iterable[list[str]]) -> int:
        """Remove every object of each page (given as its names); how many pages had one."""
        return sum(any([self.unlink(name) for name in names]) for names in pages)

    def keep_existing(self, names: list[str], nbytes: int) -> None:
        """A page already stored whole (its bytes never change): count the skipped write and
        record its objects as the most recent."""
        self.counters.write_skipped_existing += 1
        for name in names:
            self.index.add(name, nbytes)

    def present(self, pf: PoolFiles, keys: list[str], stop_at_gap: bool) -> list[bool]:
        """Is every part of each page there (one lstat each, no read)? With `stop_at_gap`
        (ALL_PAGES: only leading pages count) everything after the first gap is False."""
        if not self.root.inside(pf.rel_dir):
            return [False] * len(keys)
        out: list[bool] = []
        for key in keys:
            if stop_at_gap and out and not out[-1]:
                out.append(False)
            else:
                out.append(all(is_file(path) for path in pf.paths(key)))
        return out

    def list_pages(self, rel_dir: str, num_parts: int) -> dict[str, set[int]]:
        """Pages stored under `rel_dir` (a fresh listing, not the index) -> their complete
        KV heads."""
        if not self.root.inside(rel_dir):
            return {}
        return page_heads(object_basenames(os.path.join(self.root.path, rel_dir), self.label),
                          self.total_heads, num_parts)

    def reclaim_old_format(self, namespace: KeyNamespace, pool: str) -> int:
        """Remove format-1 objects from `<ns>/<pool>` of every namespace folder of
        `namespace`'s model under the root (this one included); how many pages went."""
        try:
            with os.scandir(self.root.path) as entries:
                folders = [e.name for e in entries
                           if same_model_namespace(e.name, namespace) and e.is_dir()]
        except OSError as exc:
            log.warning("%s: cannot list %s for old-format objects (%s)", self.label,
                        self.root.path, exc.strerror or exc)
            return 0
        pages = 0
        for folder in sorted(folders):
            rel_dir = f"{folder}/{pool}"
            if not self.root.inside(rel_dir):
                continue
            found = old_format_pages(object_basenames(os.path.join(self.root.path, rel_dir),
                                                      self.label))
            pages += self.delete([f"{rel_dir}/{b}" for b in bases] for bases in found.values())
        self.sync_stored()
        return pages


def object_basenames(directory: str, label: str = "file backend") -> list[str]:
    """Names of the regular files in `directory`, least recently used first.

    Why a fresh scan and not the index: the index is this process's view, and a listing
    must also see what other processes sharing the root have written."""
    found = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    if entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        found.append((max(st.st_atime_ns, st.st_mtime_ns), entry.name))
                except OSError:
                    continue  # removed while we listed
    except FileNotFoundError:
        return []
    except OSError as exc:
        log.warning("%s: cannot list %s (%s); its pages are not listed", label, directory,
                    exc.strerror or exc)
        return []
    return [name for _, name in sorted(found)]


def is_file(path: str) -> bool:
    """Cheap presence check (one lstat, no read): a regular file under the object name."""
    try:
        return stat.S_ISREG(os.stat(path, follow_symlinks=False).st_mode)
    except OSError:
        return False
