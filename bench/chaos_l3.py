"""The file L3 of a `kvtier bench chaos --engine vllm` run, and its faults, on this machine.

- The L3 directory is a tmpfs of its own (`L3Volume`, mounted by the bench and unmounted at
  the end; mounting needs root): a small file system that can be filled for real. `fill()`
  takes all its free space, so every write fails with ENOSPC until `drain()`. Where the
  mount is refused the directory is a plain one and the volume cannot be filled (`fill`
  says so, and that fault is not armed): the file backend's own bound evicts, it never
  fails a write, so it is no stand-in for a full disk.
- `corrupt(since)` overwrites the payload of page objects written since then with garbage of
  the same size, their header kept: only the checksum tells (backends/file_object.py), and a
  read of one is a miss that unpublishes the page.
- `LateReads`: the fault file (backends/faulty.py) every rank's L3 client follows (the
  deployment's `l3_options` name it): the reads of the rank whose KV heads start at a given
  head are delayed, and the hits counted, while a rule stands.
"""
from __future__ import annotations

import logging
import os
import subprocess
import time

from kvtier.backends.faulty import FaultKind, FileRule, StorageOp, fault_hits, write_fault_file
from kvtier.backends.file_object import HEADER_BYTES, TMP_PREFIX

log = logging.getLogger(__name__)

VOLUME_BYTES = 256 << 20
FILL_NAME = ".kvtier-chaos-fill"  # hidden: the file backend's scans skip dot files
MOUNT_TIMEOUT_S = 30.0
MAX_CORRUPT = 256  # objects overwritten by one fault at most


class L3Volume:
    """`root`, on a tmpfs of `size_bytes` when this process may mount one."""

    def __init__(self, root: str, size_bytes: int = VOLUME_BYTES) -> None:
        self.root, self.size_bytes = root, size_bytes
        os.makedirs(root, exist_ok=True)
        self.mounted = _mount_tmpfs(root, size_bytes)
        self.why_not = "" if self.mounted else "the L3 directory is not a file system of its " \
                                              "own (mounting a tmpfs was refused)"

    @property
    def _fill_path(self) -> str:
        return os.path.join(self.root, FILL_NAME)

    def fill(self) -> int:
        """Take every free byte of the volume; the bytes taken (0: not mounted)."""
        if not self.mounted:
            return 0
        st = os.statvfs(self.root)
        taken = 0
        with open(self._fill_path, "ab", buffering=0) as f:
            try:
                os.posix_fallocate(f.fileno(), 0, max(1, st.f_bavail * st.f_frsize))
            except OSError:
                pass  # fewer bytes than measured: the writes below top it up
            taken = os.fstat(f.fileno()).st_size
            chunk = b"\0" * (1 << 20)
            for _ in range(self.size_bytes // len(chunk) + 1):  # what others freed meanwhile
                try:
                    taken += f.write(chunk) or 0
                except OSError:  # ENOSPC: full
                    break
        return taken

    def free_bytes(self) -> int:
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def drain(self) -> None:
        try:
            os.unlink(self._fill_path)
        except FileNotFoundError:
            pass

    def corrupt(self, since: float, limit: int = MAX_CORRUPT) -> int:
        """Overwrite the payload of the page objects written since `since` (wall-clock
        seconds) with garbage of the same size; how many."""
        done = 0
        for path in self._objects():
            if done >= limit:
                break
            try:
                st = os.stat(path)
                if st.st_mtime < since or st.st_size <= HEADER_BYTES:
                    continue
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.pwrite(fd, os.urandom(st.st_size - HEADER_BYTES), HEADER_BYTES)
                finally:
                    os.close(fd)
            except OSError:
                continue  # evicted meanwhile
            done += 1
        return done

    def _objects(self):
        """Every page object under root/<namespace>/<pool>/ (temp files skipped)."""
        for ns in _subdirs(self.root):
            for pool in _subdirs(os.path.join(self.root, ns)):
                folder = os.path.join(self.root, ns, pool)
                try:
                    names = os.listdir(folder)
                except OSError:
                    continue
                yield from (os.path.join(folder, n) for n in names
                            if not n.startswith(TMP_PREFIX))

    def close(self) -> None:
        """Drain, and unmount what was mounted (lazily when something still holds it)."""
        self.drain()
        if self.mounted:
            _run(["umount", self.root]) or _run(["umount", "-l", self.root])
            self.mounted = False


class LateReads:
    """The fault file at `path`: delays of one rank's L3 reads while a rule stands."""

    def __init__(self, path: str) -> None:
        self.path = path
        write_fault_file(path, [])

    def delay(self, first_head: int, delay_s: float) -> None:
        """Delay every L3 read of the rank whose KV heads start at `first_head`."""
        write_fault_file(self.path, [FileRule(StorageOp.GET, FaultKind.DELAY, delay_s,
                                              first_head)])

    def clear(self) -> None:
        write_fault_file(self.path, [])

    def hits(self) -> int:
        """Reads delayed so far (by every rank's client)."""
        return fault_hits(self.path)


def _subdirs(path: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith(".")]
    except OSError:
        return []


def _mount_tmpfs(root: str, size_bytes: int) -> bool:
    if os.geteuid() != 0:
        log.warning("not root: the chaos L3 is a plain directory and cannot be filled")
        return False
    ok = _run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700",
               "kvtier-chaos-l3", root])
    if not ok:
        log.warning("mounting a tmpfs at %s failed: the chaos L3 is a plain directory and "
                    "cannot be filled", root)
    return ok


def _run(argv: list[str]) -> bool:
    started = time.monotonic()
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=MOUNT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("%s failed: %s", " ".join(argv), exc)
        return False
    if done.returncode != 0:
        log.warning("%s failed (%.1f s): %s", " ".join(argv), time.monotonic() - started,
                    done.stderr.strip()[:300])
    return done.returncode == 0
