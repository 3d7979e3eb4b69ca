"""The stored object format, as the NIXL backend reads and writes it.

The format is the file backend's (kvtier.backends.file_object): one file per page part,
a HEADER_BYTES header (magic, version, sizes, xxh3_64 of the payload, the object's own
name), then the payload. Sharing it means one root_dir serves either backend, and the
naming, verification and never-overwrite rules cannot drift apart.

Why the payload stays at offset 512 rather than 4096: NIXL's POSIX plugin does buffered
I/O here (Linux AIO on page-cache files). Raw NIXL, 512 x 737,280 B, 12 alternating runs
each way: offset 512 wrote 3.20 / read 4.90 GB/s (median), offset 4096 3.11 / 4.53; the
order-swapped run gave the same picture. Alignment would matter for O_DIRECT only, which
this backend does not use (page-cache reads beat it ~2x here).
NIXL moves the payload; this module packs the header (written with pwrite) and checks the
header it reads back before the payload is trusted.
"""
from __future__ import annotations

import functools
import os
import secrets

from kvtier.backends.file_object import (HEADER_BYTES, MAGIC, TMP_PREFIX, encode_header,
                                         object_bytes)

__all__ = ["HEADER_BYTES", "TempFiles", "check_header", "encode_header", "object_bytes",
           "temp_path"]

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | _CLOEXEC


def _layout() -> tuple[int, int]:
    """Where encode_header puts the u64 checksum (the 8 bytes that differ between two headers
    that differ only in it) and the name (right after it, then zeros to HEADER_BYTES).
    Found through the public encoder, not restated here."""
    a, b = encode_header(b"x", 1, 0), encode_header(b"x", 1, (1 << 64) - 1)
    diff = [i for i in range(len(a)) if a[i] != b[i]]
    assert diff == list(range(diff[0], diff[0] + 8)), "file_object's checksum is not one u64"
    name_at = diff[0] + 8
    sample, other = encode_header(b"xyz", 5, 7), encode_header(b"abc", 5, 7)
    assert sample[name_at:] == b"xyz" + bytes(HEADER_BYTES - name_at - 3) and \
        sample[:name_at] == other[:name_at], \
        "file_object's header no longer ends with the name and zero padding"
    return diff[0], name_at


_CHECKSUM_AT, _NAME_AT = _layout()


@functools.lru_cache(maxsize=64)
def _head(name_len: int, payload_len: int) -> bytes:
    """encode_header's bytes before the checksum: the same for every name of that length
    (one per pool and name length: cached)."""
    return encode_header(bytes(name_len), payload_len, 0)[:_CHECKSUM_AT]


@functools.lru_cache(maxsize=64)
def _padding(name_len: int) -> bytes:
    return bytes(HEADER_BYTES - _NAME_AT - name_len)


def check_header(block: bytes, name: bytes, payload_len: int) -> tuple[int | None, str]:
    """(stored checksum, "") when `block` is exactly the header that `name` with
    `payload_len` bytes and that checksum would have, else (None, why not).

    Byte equality with encode_header's output (its bytes before the checksum, then the
    name and zero padding after it) checks magic, version, sizes, the name and the padding
    at once, in the file backend's own encoding; two comparisons, no header built per call.
    """
    if len(block) < HEADER_BYTES:
        return None, f"truncated header ({len(block)} bytes)"
    block = block[:HEADER_BYTES]
    if (block.startswith(_head(len(name), payload_len))
            and block.endswith(name + _padding(len(name)))):
        return int.from_bytes(block[_CHECKSUM_AT:_NAME_AT], "little"), ""
    if not block.startswith(MAGIC):
        return None, "not a kvtier object (bad magic)"
    if name not in block:
        return None, "foreign object: its header names another object"
    return None, "header differs (format version, payload length or padding)"


def temp_path(path: str) -> str:
    """A private sibling of `path` to write into before the atomic link (same directory,
    hidden by TMP_PREFIX so scans skip it and clear it when its writer died)."""
    head, tail = os.path.split(path)
    return os.path.join(head, f"{TMP_PREFIX}{tail}.{os.getpid()}.{secrets.token_hex(6)}.tmp")


class TempFiles:
    """Files written before they have a name, then linked under it (never replacing one).

    Where the file system allows it (ext4, xfs, tmpfs) the file is unnamed (O_TMPFILE) and
    linked through /proc/self/fd: no temp name to create and unlink (two metadata operations
    per object fewer, which measured as the noisiest part of a write), and nothing left
    behind by a writer that dies. Elsewhere: a hidden named sibling, linked then unlinked.
    """

    def __init__(self, root: str) -> None:
        self._proc_fd, self._pid = -1, -1
        self.unnamed = False
        try:
            self._open_proc()
            probe = os.path.join(root, f"{TMP_PREFIX}kvtier-probe-{secrets.token_hex(6)}")
            fd, _ = self._create_unnamed(probe)
            try:
                self._link_unnamed(fd, probe)
                os.unlink(probe)
            finally:
                os.close(fd)
            self.unnamed = True
        except (OSError, AttributeError):  # no O_TMPFILE, no /proc: named temp files
            self.close()

    def create(self, path: str) -> tuple[int, str]:
        """A writable fd for the future `path`, and the temp name to unlink afterwards ("")."""
        if self.unnamed:
            return self._create_unnamed(path)
        tmp = temp_path(path)
        return os.open(tmp, _TMP_FLAGS, 0o600), tmp

    def link(self, fd: int, tmp: str, path: str) -> None:
        """Give the file its name; FileExistsError when another writer was first."""
        if tmp:
            os.link(tmp, path)
        else:
            self._link_unnamed(fd, path)

    def _create_unnamed(self, path: str) -> tuple[int, str]:
        return os.open(os.path.dirname(path), os.O_WRONLY | os.O_TMPFILE | _CLOEXEC, 0o600), ""

    def _link_unnamed(self, fd: int, path: str) -> None:
        if self._pid != os.getpid():  # a forked child: /proc/self/fd must be its own
            self._open_proc()
        # linkat(/proc/self/fd, "<fd>", path, AT_SYMLINK_FOLLOW): a src_dir_fd makes Python
        # call linkat with the follow flag, which names the open file itself.
        os.link(str(fd), path, src_dir_fd=self._proc_fd)

    def _open_proc(self) -> None:
        if self._proc_fd >= 0:
            os.close(self._proc_fd)
        self._proc_fd = os.open("/proc/self/fd", os.O_RDONLY | _DIRECTORY | _CLOEXEC)
        self._pid = os.getpid()

    def close(self) -> None:
        if self._proc_fd >= 0:
            os.close(self._proc_fd)
            self._proc_fd = -1
        self.unnamed = False
