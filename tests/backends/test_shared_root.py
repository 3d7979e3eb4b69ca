"""The shared-root marker (backends/shared_root.py): written once, kept, read back by ranks."""
from __future__ import annotations

import pytest

from kvtier.backends.shared_root import (MARKER_PREFIX, RootNotShared, check_marker,
                                         ensure_marker, marker_path, shared_root_dir)
from kvtier.errors import ConfigError
from kvtier.storage_options import FileOptions, MooncakeOptions, NixlOptions, SimulatedOptions

NS = "ns-0123"


def test_the_marker_is_written_once_and_kept(tmp_path):
    root = tmp_path / "l3"  # created by ensure_marker
    token = ensure_marker(str(root), NS)
    assert (root / f"{MARKER_PREFIX}{NS}").is_file() and len(token) == 32
    assert ensure_marker(str(root), NS) == token  # a restarted actor reads it back
    assert ensure_marker(str(root), NS, "another") == token  # never overwritten
    check_marker(str(root), NS, token)  # one host: the same directory passes
    assert [p.name for p in root.iterdir()] == [f"{MARKER_PREFIX}{NS}"]  # no temp file left


def test_a_removed_marker_is_rewritten_with_the_token_given(tmp_path):
    token = ensure_marker(str(tmp_path), NS)
    (tmp_path / f"{MARKER_PREFIX}{NS}").unlink()
    assert ensure_marker(str(tmp_path), NS, token) == token
    check_marker(str(tmp_path), NS, token)


@pytest.mark.parametrize("damage, why", [("remove", "has no marker"),
                                          ("other", "another token"),
                                          ("garbage", "damaged marker")])
def test_a_root_without_the_marker_is_refused(tmp_path, damage, why):
    token = ensure_marker(str(tmp_path), NS)
    path = tmp_path / f"{MARKER_PREFIX}{NS}"
    if damage == "remove":
        path.unlink()
    elif damage == "other":
        path.unlink()
        ensure_marker(str(tmp_path), NS, "f" * 32)
    else:
        path.write_text("not a marker")
    with pytest.raises(RootNotShared, match=why) as err:
        check_marker(str(tmp_path), NS, token, node="node-b (10.0.0.2)")
    msg = str(err.value)
    assert isinstance(err.value, ConfigError)
    assert "root_dir" in msg and "a filesystem mounted on every node" in msg
    assert str(tmp_path) in msg and "node-b (10.0.0.2)" in msg


def test_a_directory_the_rank_does_not_have_is_refused(tmp_path):
    token = ensure_marker(str(tmp_path / "on-the-head"), NS)
    with pytest.raises(RootNotShared, match="has no marker"):
        check_marker(str(tmp_path / "elsewhere"), NS, token)
    assert not (tmp_path / "elsewhere").exists()  # the check creates nothing


def test_which_backends_have_a_shared_root():
    assert shared_root_dir(FileOptions(root_dir="/data/kv")) == "/data/kv"
    assert shared_root_dir(NixlOptions(root_dir="/data/nx")) == "/data/nx"
    assert shared_root_dir(MooncakeOptions()) is None
    assert shared_root_dir(SimulatedOptions()) is None
    assert marker_path("/data/kv", NS) == f"/data/kv/{MARKER_PREFIX}{NS}"
