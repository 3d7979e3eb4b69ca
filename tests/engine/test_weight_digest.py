"""The host's cache of weight digests (engine/weight_digest.py): hashed once, hashed again
whenever a file may have changed, never wrong, and a damaged cache is only a re-hash."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import opened_files
import pytest

from kvtier.engine import weight_digest
from kvtier.engine.weight_digest import weights_digest


@pytest.fixture
def files(tmp_path, monkeypatch) -> list[Path]:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    out = []
    for i in range(2):
        out.append(tmp_path / f"model-0000{i}.safetensors")
        out[-1].write_bytes(bytes(range(256)) * (i + 3))
    return out


@pytest.fixture
def opened(monkeypatch) -> list[str]:
    """Names of the weight files opened from now on."""
    return opened_files.opened(monkeypatch, ".safetensors")


def plain_sha256(files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        with open(path, "rb") as fh:  # not Path.open: not counted as the cache's reads
            h.update(path.name.encode() + b"\0" + fh.read())
    return h.hexdigest()


def entries() -> list[Path]:
    return sorted((Path(os.environ["KVTIER_CACHE_DIR"]) / "digests").glob("*.json"))


def test_the_second_ask_reads_no_weight_file(files, opened):
    first = weights_digest(files)
    assert first == plain_sha256(files) and len(opened) == 2
    assert weights_digest(files) == first and len(opened) == 2
    assert len(entries()) == 1


def test_a_touched_or_rewritten_file_is_hashed_again(files, opened):
    first = weights_digest(files)
    st = files[1].stat()
    os.utime(files[1], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert weights_digest(files) == first and len(opened) == 4  # the same bytes, read again
    # other bytes of the same size and modification time: ctime tells, never a stale digest
    st = files[0].stat()
    files[0].write_bytes(bytes(reversed(files[0].read_bytes())))
    os.utime(files[0], ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights_digest(files) == plain_sha256(files) != first


def test_a_damaged_entry_is_hashed_again_and_rewritten(files, opened):
    first = weights_digest(files)
    for junk in ("{not json", '{"files": [], "digest": "00"}', "[1, 2]", ""):
        entries()[0].write_text(junk)
        assert weights_digest(files) == first
        assert weights_digest(files) == first  # rewritten whole: the next ask reads nothing
    assert len(opened) == 2 * 5


def test_a_cache_that_cannot_be_written_only_costs_the_hashing(files, opened, tmp_path,
                                                               monkeypatch, caplog):
    (tmp_path / "not-a-dir").write_text("")
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "not-a-dir"))
    assert weights_digest(files) == weights_digest(files) == plain_sha256(files)
    assert len(opened) == 4 and "KVTIER_CACHE_DIR" in caplog.text


def test_the_cache_keeps_at_most_max_entries(files, monkeypatch):
    monkeypatch.setattr(weight_digest, "MAX_ENTRIES", 2)
    for i in range(4):
        files[0].write_bytes(bytes([i]) * 10)
        weights_digest(files)
    assert len(entries()) == 2
