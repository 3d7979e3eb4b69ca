"""The SHA-256 of a checkpoint's weight files, hashed once per host.

Every process that opens a checkpoint directory needs its digest (`HFModelDir.digest`: each
rank of kvtier's engine; under vLLM the front end, the EngineCore and every worker, through
connector/identity.py), and hashing gigabytes takes seconds to minutes each time. So each
digest is kept in a small file under `<cache root>/digests/` (the cache root of
engine/weights.py: `$KVTIER_CACHE_DIR`, else `~/.cache/kvtier`), keyed by what tells a
file's bytes apart without reading them: its name, resolved path, device, inode, size,
mtime_ns and ctime_ns. A file rewritten, touched, replaced or renamed changes one of them, so
its digest is hashed again: never a stale one (a user cannot set ctime back).

Entries are written atomically (a temporary file renamed over the entry), so a reader sees a
whole entry or none. An entry that cannot be read, does not parse, or was written for other
files is ignored and written again; a cache that cannot be written costs only the hashing.
At most MAX_ENTRIES entries are kept: writing one more removes the least recently written.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Sequence

from kvtier.engine.weights import cache_root

log = logging.getLogger(__name__)

DIR_NAME = "digests"
MAX_ENTRIES = 256
_CHUNK = 1 << 20


def weights_digest(files: Sequence[Path], cache_dir: str | os.PathLike | None = None) -> str:
    """SHA-256 over `files` (each name, a NUL, then its bytes): from the host's cache when
    the files are the ones it was hashed from, else hashed and cached."""
    stamp = _stamp(files)
    entry = cache_root(cache_dir) / DIR_NAME / f"{_key(stamp)}.json"
    known = _read(entry, stamp)
    if known is not None:
        return known
    digest = _hash(files)
    if _stamp(files) == stamp:  # not changed while it was read: the digest is of `stamp`
        _write(entry, stamp, digest)
    return digest


def _stamp(files: Sequence[Path]) -> list[list]:
    out = []
    for path in files:
        st = path.stat()
        out.append([path.name, str(path.resolve()), st.st_dev, st.st_ino, st.st_size,
                    st.st_mtime_ns, st.st_ctime_ns])
    return out


def _key(stamp: list[list]) -> str:
    return hashlib.sha256(json.dumps(stamp).encode()).hexdigest()[:32]


def _hash(files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(path.name.encode() + b"\0")
        with path.open("rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def _read(entry: Path, stamp: list[list]) -> str | None:
    """The digest `entry` holds for exactly `stamp`, or None (absent, unreadable, corrupt)."""
    try:
        data = json.loads(entry.read_text())
        digest = data["digest"]
        if data["files"] != stamp or not isinstance(digest, str) or len(digest) != 64:
            return None
        int(digest, 16)  # ValueError unless hex digits
        return digest
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        log.info("weight digest cache: ignoring %s (%s); hashing again", entry, exc)
        return None


def _write(entry: Path, stamp: list[list], digest: str) -> None:
    """Write the entry atomically, then drop the oldest past MAX_ENTRIES; failures only log."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=entry.parent)
        try:
            with os.fdopen(fd, "w") as fh:
                json.dump({"files": stamp, "digest": digest}, fh)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is meant to be shared
            os.replace(tmp, entry)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        _prune(entry.parent)
    except OSError as exc:
        log.warning("weight digest cache: cannot write %s (%s); the digest is hashed again "
                    "by the next process (set KVTIER_CACHE_DIR to a writable directory)",
                    entry, exc)


def _prune(directory: Path) -> None:
    entries = []
    for path in directory.glob("*.json"):
        try:
            entries.append((path.stat().st_mtime_ns, path))
        except FileNotFoundError:  # another process pruned it
            continue
    for _, path in sorted(entries)[:max(0, len(entries) - MAX_ENTRIES)]:
        path.unlink(missing_ok=True)
