"""One stored page part as a file: a small fixed header, then the payload bytes.

Header (HEADER_BYTES, little-endian): magic, format version, header size, name length,
payload length, xxh3_64 of the payload, then the object's own name, zero-padded. The name
makes a file copied or renamed under another page's name foreign (a miss), not wrong KV.

Why 512 bytes and not 4096: the backend uses buffered I/O (page-cache reads/writes beat
O_DIRECT here, see machine-notes), so the header only has to fit the longest object name;
a 4 KiB header measured no faster and costs 0.5% more disk per 737 KB object.

Writes never replace an existing object: the bytes go to a private temporary file in the
same directory, which is then hard-linked under the final name (link fails with EEXIST
instead of replacing, atomically) and unlinked. Readers therefore see either no file or a
complete one, whichever process wrote it.
"""
from __future__ import annotations

import enum
import errno
import functools
import os
import secrets
import struct
from typing import NamedTuple, Sequence

import xxhash

MAGIC = b"KVTIERO\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 512
_FIXED = struct.Struct("<8sHHIQQ")  # magic, version, header size, name len, payload len, xxh3
_CHECKSUM_AT = 24  # offset of the checksum inside _FIXED
MAX_NAME_BYTES = HEADER_BYTES - _FIXED.size
TMP_PREFIX = "."  # temporary files are hidden: scans skip them, names never start with "."
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_TMP_FLAGS = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
              | getattr(os, "O_CLOEXEC", 0))


class ReadStatus(enum.Enum):
    OK = "ok"
    MISSING = "missing"  # no file (or the storage is gone): a plain miss
    CORRUPT = "corrupt"  # a file was there but bad: removed
    ERROR = "error"  # an I/O error other than absence: a miss, the file is left alone


class ReadOutcome(NamedTuple):
    status: ReadStatus
    file_bytes: int = 0  # size of the file read (header + payload) when it existed
    reason: str = ""


class WriteStatus(enum.Enum):
    WRITTEN = "written"
    EXISTED = "existed"  # another writer linked the same name first: kept theirs
    NO_DIR = "no_dir"  # the directory vanished (an operator, a cleanup): re-create and retry
    FAILED = "failed"


class WriteOutcome(NamedTuple):
    status: WriteStatus
    file_bytes: int = 0
    reason: str = ""


def object_bytes(payload_len: int) -> int:
    """Size on disk of an object with `payload_len` payload bytes."""
    return HEADER_BYTES + payload_len


def encode_header(name: bytes, payload_len: int, checksum: int) -> bytes:
    if len(name) > MAX_NAME_BYTES:
        raise ValueError(f"object name of {len(name)} bytes exceeds {MAX_NAME_BYTES}")
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, len(name), payload_len, checksum)
    return fixed + name + bytes(HEADER_BYTES - len(fixed) - len(name))


@functools.lru_cache(maxsize=64)
def _fixed_prefix(name_len: int, payload_len: int) -> bytes:
    """The header bytes before the checksum (one per pool and name length: cached)."""
    return encode_header(bytes(name_len), payload_len, 0)[:_CHECKSUM_AT]


@functools.lru_cache(maxsize=64)
def _zeros(n: int) -> bytes:
    return bytes(n)


def _problem(header: bytearray, got: int, name: bytes, payload_len: int) -> str:
    """Why an object read as `got` bytes with this header is not object `name` (for the log)."""
    if got < HEADER_BYTES:
        return f"truncated header ({got} bytes)"
    magic, version, hbytes, name_len, plen, _ = _FIXED.unpack_from(header)
    if magic != MAGIC:
        return "not a kvtier object (bad magic)"
    if version != FORMAT_VERSION or hbytes != HEADER_BYTES:
        return f"format version {version} / header {hbytes} B (this kvtier reads {FORMAT_VERSION})"
    if name_len != len(name) or header[_FIXED.size:_FIXED.size + name_len] != name:
        return "foreign object: its header names another object"
    if plen != payload_len:
        return f"payload length {plen}, expected {payload_len}"
    if any(header[_FIXED.size + name_len:]):
        return "header padding is not zero"
    size = object_bytes(payload_len)
    return f"file is {'longer' if got > size else 'shorter'} than its header says"


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """The buffers left after `n` bytes of a vectored transfer completed."""
    while bufs and n >= len(bufs[0]):
        n -= len(bufs[0])
        bufs = bufs[1:]
    if bufs and n:
        bufs = [bufs[0][n:]] + bufs[1:]
    return bufs


def _writev_fully(fd: int, bufs: Sequence[memoryview]) -> None:
    left = [b for b in bufs if len(b)]
    while left:
        left = _advance(left, os.writev(fd, left))


def _readv_fully(fd: int, bufs: Sequence[memoryview], need: int) -> int:
    """Read into `bufs` in order until `need` bytes arrived or the file ended; returns the
    bytes read. Buffers past `need` (a probe for an over-long file) fill only if the same
    call reaches them: a regular file's short read means end of file, no second call."""
    left, total = [b for b in bufs if len(b)], 0
    while left and total < need:
        n = os.readv(fd, left)
        if n == 0:
            break
        total += n
        left = _advance(left, n)
    return total


def write_object(path: str, name: bytes, payload: memoryview, fsync: bool) -> WriteOutcome:
    """Write `payload` (read in place, no copy) as object `name` at `path`, never replacing one."""
    header = encode_header(name, len(payload), xxhash.xxh3_64_intdigest(payload))
    directory, base = os.path.split(path)
    tmp = os.path.join(directory, f"{TMP_PREFIX}{base}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, _TMP_FLAGS, 0o600)
    except FileNotFoundError:
        return WriteOutcome(WriteStatus.NO_DIR, 0, f"no directory {directory}")
    except OSError as exc:
        return WriteOutcome(WriteStatus.FAILED, 0, f"{exc.strerror or exc} creating {tmp}")
    try:
        try:
            _writev_fully(fd, [memoryview(header), payload])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # atomic, and EEXIST instead of replacing: pages never change
        except FileExistsError:
            return WriteOutcome(WriteStatus.EXISTED, object_bytes(len(payload)))
        if fsync:
            _fsync_dir(directory)
        return WriteOutcome(WriteStatus.WRITTEN, object_bytes(len(payload)))
    except OSError as exc:
        return WriteOutcome(WriteStatus.FAILED, 0, f"{exc.strerror or exc} writing {path}")
    finally:
        _unlink_quietly(tmp)


def read_object(path: str, name: bytes, out: memoryview, verify: bool = True) -> ReadOutcome:
    """Read object `name` at `path` straight into `out` and verify it.

    A bad object (short, long, foreign, wrong checksum, a symlink) is removed, so the next
    `exists` no longer reports it. `out` holds garbage unless the outcome is OK. With
    `verify` False the payload's xxh3 is not compared (the header and size still are).
    """
    try:
        fd = os.open(path, _READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return ReadOutcome(ReadStatus.MISSING)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            _unlink_quietly(path)  # a symlink under an object name: never follow it
            return ReadOutcome(ReadStatus.CORRUPT, 0, "symlink under an object name")
        return ReadOutcome(ReadStatus.ERROR, 0, f"{exc.strerror or exc}")
    try:
        header, extra = bytearray(HEADER_BYTES), bytearray(1)  # `extra` catches a too-long file
        bufs, size = [memoryview(header), out, memoryview(extra)], object_bytes(len(out))
        try:
            got = os.readv(fd, bufs)  # one call: a regular file's short read means its end
            if 0 < got < size:  # ...except on filesystems that may stop early: keep reading
                got += _readv_fully(fd, _advance(bufs, got), size - got)
        except OSError as exc:
            return ReadOutcome(ReadStatus.ERROR, 0, f"{exc.strerror or exc}")
        end = _FIXED.size + len(name)  # everything but the checksum is known in advance:
        if (got == size and header[:_CHECKSUM_AT] == _fixed_prefix(len(name), len(out))
                and header[_FIXED.size:end] == name and header[end:] == _zeros(HEADER_BYTES - end)):
            stored = int.from_bytes(header[_CHECKSUM_AT:_CHECKSUM_AT + 8], "little")
            if not verify or xxhash.xxh3_64_intdigest(out) == stored:
                return ReadOutcome(ReadStatus.OK, size)
            problem = "checksum mismatch"
        else:
            problem = _problem(header, got, name, len(out))
        _remove_if_same(path, os.fstat(fd))
        return ReadOutcome(ReadStatus.CORRUPT, 0, problem)
    finally:
        os.close(fd)


def _remove_if_same(path: str, st: os.stat_result) -> None:
    """Unlink `path` only if it is still the file we judged (another writer may have replaced
    a removed object with a good one in between)."""
    try:
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)
    except OSError:
        pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _fsync_dir(directory: str) -> None:
    """Make a new directory entry durable (fsync option): the file alone is not enough."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
