"""A deployment's file or nixl L3 is bounded by default: `auto` is half the disk space free
where the L3 root lives, measured once at start (every instance registers the same bound) and
printed by `kvtier serve`; unbounded only when asked. No Ray: the settings, the options each
instance registers and `kvtier serve`'s start line, with the free space faked."""
from __future__ import annotations

import argparse
import shutil

import pytest

import kvtier.frontend.l3_bound as l3_bound
from kvtier.cli import serve_command
from kvtier.actors import serve_graph
from kvtier.actors.serve_replica import bound_attach_options, l3_options
from kvtier.policies import StorageBackendKind
from kvtier.frontend.l3_bound import AUTO_DISK_SHARE, GiB, L3Bound, free_bytes_at
from kvtier.frontend.settings import ServeSettings

FREE = 40 * GiB
FILE = StorageBackendKind.FILE


@pytest.fixture
def free_disk(monkeypatch):
    """The disk under any L3 root has FREE bytes free; the roots asked about, in order."""
    asked: list[str] = []

    def free(path: str) -> int:
        asked.append(path)
        return FREE

    monkeypatch.setattr(l3_bound, "free_bytes_at", free)
    return asked


def test_kvtier_serve_bounds_its_file_l3_by_default(free_disk, tmp_path):
    s = serve_graph.resolve(ServeSettings(l3_root=str(tmp_path)))
    assert s.l3_max_gb == AUTO_DISK_SHARE * FREE / GiB == 20.0
    assert free_disk == [str(tmp_path)]
    assert l3_options(FILE, s, None) == {"root_dir": str(tmp_path), "max_size_bytes": 20 * GiB}
    assert serve_graph.resolve(s) == s  # measured once: the instances get the same bound
    again = ServeSettings.from_mapping(s.to_mapping())  # as every deployment reads them
    assert l3_options(FILE, again, None) == l3_options(FILE, s, None)
    temp = serve_graph.resolve(ServeSettings())  # no root given: a temporary one, bounded too
    try:
        assert l3_options(FILE, temp, None)["max_size_bytes"] == 20 * GiB
    finally:
        shutil.rmtree(temp.l3_root)


def test_unbounded_only_when_asked_and_serve_configs_keep_working(free_disk, tmp_path):
    root = str(tmp_path)
    for asked in ("unbounded", "UNBOUNDED", 0, 0.0):  # 0: what "unbounded" was spelt before
        s = serve_graph.resolve(ServeSettings.from_mapping({"l3_root": root, "l3_max_gb": asked}))
        assert s.l3_max_gb is L3Bound.UNBOUNDED and "max_size_bytes" not in l3_options(FILE, s,
                                                                                        None)
    for asked in (2, 2.5, "2.5"):
        s = serve_graph.resolve(ServeSettings.from_mapping({"l3_root": root, "l3_max_gb": asked}))
        assert l3_options(FILE, s, None)["max_size_bytes"] == int(float(asked) * GiB)
    auto = ServeSettings.from_mapping({"l3_max_gb": "auto"})
    assert auto.l3_max_gb is L3Bound.AUTO == ServeSettings().l3_max_gb
    assert ServeSettings.from_mapping(auto.to_mapping()).l3_max_gb is L3Bound.AUTO
    assert free_disk == []  # nothing measured for a size, unbounded, or before resolving
    # a caller's own bound wins (0: unbounded), as before
    s = serve_graph.resolve(ServeSettings(l3_root=root))
    assert l3_options(FILE, s, {"max_size_bytes": 0})["max_size_bytes"] == 0


def test_an_admin_attach_is_bounded_once_for_every_instance(free_disk, tmp_path):
    s = ServeSettings(storage_backend=None, l3_root="")  # nothing to measure at start
    assert serve_graph.resolve(s).l3_max_gb is L3Bound.AUTO
    body = {"backend": "file", "options": {"root_dir": str(tmp_path / "new")}}
    first = bound_attach_options(s, body)
    assert bound_attach_options(s, body) == first  # the second instance: the same options
    assert first == {"root_dir": str(tmp_path / "new"), "max_size_bytes": 20 * GiB}
    assert free_disk == [str(tmp_path / "new")]
    mooncake = {"backend": "mooncake"}
    assert bound_attach_options(s, mooncake) is None and free_disk == [str(tmp_path / "new")]


def test_kvtier_serve_prints_the_bound_at_start(free_disk, tmp_path, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(serve_graph, "serve_forever", lambda s, *a: started.append(s))

    def serve(*argv: str) -> str:
        parser = argparse.ArgumentParser()
        serve_command.add_arguments(parser)
        assert serve_command.main(parser.parse_args(["--l3-root", str(tmp_path), *argv])) == 0
        return capsys.readouterr().out

    out = serve()
    assert "bounded at 20.00 GiB, 50% of the disk space free" in out and "unbounded" in out
    assert started[-1].l3_max_gb == 20.0
    assert "bounded at 3 GiB" in serve("--l3-max-gb", "3")
    assert "is unbounded, as asked" in serve("--l3-max-gb", "unbounded")
    assert "L3" not in serve("--l3", "none")


def test_the_free_space_is_measured_where_the_root_will_be(tmp_path):
    assert free_bytes_at(str(tmp_path / "not" / "made" / "yet")) > 0
    assert l3_bound.auto_l3_gb(str(tmp_path), free_bytes=0) * GiB == l3_bound.MIN_AUTO_BYTES


def test_more_backend_options_reach_every_instance_but_not_the_bound(free_disk, tmp_path):
    from kvtier.errors import ConfigError

    faults = str(tmp_path / "faults.json")
    s = serve_graph.resolve(ServeSettings(l3_root=str(tmp_path),
                                          l3_options={"fsync": True, "fault_file": faults}))
    again = ServeSettings.from_mapping(s.to_mapping())
    assert l3_options(FILE, again, None) == {"fsync": True, "fault_file": faults,
                                             "root_dir": str(tmp_path),
                                             "max_size_bytes": 20 * GiB}
    assert l3_options(FILE, s, {"fsync": False})["fsync"] is False  # an attach's own win
    mooncake = l3_options(StorageBackendKind.MOONCAKE, s, {"master_address": "127.0.0.1:1"})
    assert "fsync" not in mooncake  # another backend attached: not its options
    for options, needle in (({"root_dir": "/x"}, "l3_root"), ({"max_size_bytes": 1}, "l3_max_gb"),
                            ({"fsync": "yes"}, "fsync"), ({"nope": 1}, "nope"), ([1], "mapping")):
        with pytest.raises(ConfigError, match=needle):
            ServeSettings(l3_options=options)
    with pytest.raises(ConfigError, match="no L3"):
        ServeSettings(storage_backend="none", l3_options={"fsync": True})
