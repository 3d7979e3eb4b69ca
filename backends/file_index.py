"""The file backend's in-memory index: object sizes in least-recently-used order.

Why in memory and not file atimes: most mounts use `relatime`, so atimes say little about
recent reads, and an LRU decision per write must not stat the whole tree. The index is rebuilt
once at attach by scanning `root/<namespace>/<pool>/` (one stat per file: 100k files take
~0.5 s on the 2-core dev VM, 35 MB peak), ordered by each file's latest atime/mtime, then
kept current by this process's own reads, writes and deletes. Other processes sharing the
directory are learned about when this one touches their objects; each process bounds what
it knows of.
"""
from __future__ import annotations

import logging
import os
import re
import time
from collections import OrderedDict
from operator import itemgetter
from typing import NamedTuple

from kvtier.backends.file_object import TMP_PREFIX

log = logging.getLogger(__name__)

STALE_TMP_S = 3600.0  # temp files this old belong to a writer that died mid-write
_OBJECT_RE = re.compile(r"^([0-9a-f]{64})_h(\d{1,4})_([kv])$")
_PARTS = ("k", "v")


class ScanReport(NamedTuple):
    objects: int
    stored_bytes: int
    stale_tmp_removed: int
    seconds: float


def page_siblings(name: str, total_heads: int) -> list[str]:
    """Every object of the page that `name` belongs to: all parts of all `total_heads` KV
    heads.

    Evicting one head's part alone would hide the page from every reader (a page is whole
    or a miss) while the other parts keep using space, so eviction removes the page whole.
    """
    directory, base = name.rsplit("/", 1)
    m = _OBJECT_RE.match(base)
    if not m:
        return [name]
    page_hash = m.group(1)
    return [f"{directory}/{page_hash}_h{h}_{p}" for h in range(total_heads) for p in _PARTS]


class ObjectIndex:
    """Object name (relative to root) -> file bytes, oldest use first."""

    def __init__(self) -> None:
        self._lru: OrderedDict[str, int] = OrderedDict()
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, name: str) -> bool:
        return name in self._lru

    def add(self, name: str, nbytes: int) -> None:
        """Record an object that exists now (written, found or read) as the most recent."""
        old = self._lru.pop(name, 0)
        self._lru[name] = nbytes
        self.total_bytes += nbytes - old

    def touch(self, name: str) -> None:
        if name in self._lru:
            self._lru.move_to_end(name)

    def discard(self, name: str) -> int:
        """Forget an object; returns the bytes it held (0 when unknown)."""
        nbytes = self._lru.pop(name, 0)
        self.total_bytes -= nbytes
        return nbytes

    def oldest(self) -> str | None:
        return next(iter(self._lru), None)

    @classmethod
    def scan(cls, root: str) -> tuple["ObjectIndex", ScanReport]:
        """Index every object under `root/<namespace>/<pool>/`; remove stale temp files."""
        start, now = time.monotonic(), time.time()
        found: list[tuple[int, str, int]] = []
        stale = 0
        for ns in _subdirs(root):
            for pool in _subdirs(os.path.join(root, ns)):
                rel = f"{ns}/{pool}/"
                try:
                    with os.scandir(os.path.join(root, rel)) as entries:
                        for entry in entries:  # lazily: no list of 100k DirEntry objects
                            stale += _visit(entry, rel, now, found)
                except OSError as exc:
                    log.warning("file backend: cannot list %s/%s (%s); its objects are not "
                                "indexed", root, rel, exc)
        found.sort(key=itemgetter(0))
        index = cls()
        index._lru = OrderedDict((name, size) for _, name, size in found)
        index.total_bytes = sum(size for _, _, size in found)
        return index, ScanReport(len(found), index.total_bytes, stale, time.monotonic() - start)


def _visit(entry: os.DirEntry, rel: str, now: float, found: list[tuple[int, str, int]]) -> int:
    """Add one directory entry to `found` if it is an object; 1 if it was a stale temp file
    (now removed), else 0."""
    name = entry.name
    try:
        if not entry.is_file(follow_symlinks=False):
            return 0
        if name.startswith(TMP_PREFIX):
            if now - entry.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                return _remove(entry.path)
            return 0
        # `<64 hex>_h<head>_<k|v>`: a cheap shape test per file (a regex costs 3x); objects
        # of the old format (`_<rank>_<size>_`) are not indexed: they are reclaimed, not read
        if len(name) < 69 or name[64:66] != "_h" or name[-2:] not in ("_k", "_v"):
            return 0
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return 0  # removed while we scanned
    found.append((max(st.st_atime_ns, st.st_mtime_ns), rel + name, st.st_size))
    return 0


def _subdirs(path: str) -> list[str]:
    try:
        with os.scandir(path) as it:
            return [e.name for e in it if not e.name.startswith(".") and _is_dir(e)]
    except OSError as exc:
        log.warning("file backend: cannot list %s (%s); its objects are not indexed", path, exc)
        return []


def _is_dir(entry: os.DirEntry) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _remove(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except OSError:
        return 0
