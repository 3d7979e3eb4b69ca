"""The L3 root directory (file and nixl backends): created and probed at attach, the fence
around every path.

Object names are validated where they are made (`StorageTarget.object_name`: no client text,
no `..`); this is the second fence, at the filesystem: a name never resolves outside the
root, not through `..` and not through a symlinked directory planted inside it.
"""
from __future__ import annotations

import logging
import os
import tempfile

from kvtier.backends.base import StorageUnavailable
from kvtier.errors import CacheUsageError

log = logging.getLogger(__name__)

DIR_MODE = 0o700  # pages are a tenant's KV: readable by the serving user only


class FileRoot:
    """`root_dir` made real: checked once, then every object path is built through it."""

    def __init__(self, root_dir: str, label: str = "file backend") -> None:
        self.label = label  # which backend the log lines and errors name
        self.path = attach_root(root_dir, label)
        self._ready: set[str] = set()  # relative dirs that exist and resolve inside the root
        self._warned: set[str] = set()

    def inside(self, rel_dir: str) -> bool:
        """Does `root/rel_dir` resolve inside the root? Cached once the directory exists."""
        if rel_dir in self._ready:
            return True
        full = os.path.join(self.path, rel_dir)
        if os.path.realpath(full) != os.path.normpath(full):
            if rel_dir not in self._warned:
                self._warned.add(rel_dir)
                log.warning("%s: %s resolves outside %s (a symlink?); its objects are treated "
                            "as missing: remove the link", self.label, full, self.path)
            return False
        if os.path.isdir(full):
            self._ready.add(rel_dir)
        return True

    def object_path(self, name: str) -> str | None:
        """Absolute path of object `name`, or None when its directory leads out of the root."""
        path = object_path(self.path, name)
        return path if self.inside(name.rpartition("/")[0]) else None

    def ensure_dir(self, rel_dir: str) -> bool:
        """Create `root/<namespace>/<pool>` (mode 0700) once; False when that is impossible."""
        if rel_dir in self._ready:
            return True
        path = self.path
        for part in rel_dir.split("/"):
            path = os.path.join(path, part)
            try:
                os.mkdir(path, DIR_MODE)
            except FileExistsError:
                pass
            except OSError as exc:
                log.warning("%s: cannot create %s (%s)", self.label, path, exc.strerror or exc)
                return False
        if not os.path.isdir(path) or not self.inside(rel_dir):
            log.warning("%s: %s is not a directory inside %s", self.label, path, self.path)
            return False
        self._ready.add(rel_dir)
        return True

    def forget_dir(self, rel_dir: str) -> None:
        """The directory vanished (an operator, a cleanup): check and create it again."""
        self._ready.discard(rel_dir)


def object_path(root: str, name: str) -> str:
    """`root/name`, refusing names that could leave root (`..`, absolute, empty parts)."""
    parts = name.split("/")
    if name.startswith("/") or "\x00" in name or any(p in ("", ".", "..") for p in parts):
        raise CacheUsageError(f"object name {name!r:.120} would leave root_dir {root}")
    return os.path.join(root, name)


def attach_root(root_dir: str, label: str = "file backend") -> str:
    """Create (0700) and probe `root_dir`; its real path, or StorageUnavailable saying why."""
    root = os.path.abspath(root_dir)
    try:
        os.makedirs(root, mode=DIR_MODE, exist_ok=True)
        root = os.path.realpath(root)
        fd, probe = tempfile.mkstemp(prefix=".kvtier-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise StorageUnavailable(
            f"{label}: root_dir {root_dir!r} cannot be used ({exc.strerror or exc}); "
            "point storage_options root_dir at a writable directory (or fix its permissions, "
            "or remove the file in its way)") from exc
    return root
