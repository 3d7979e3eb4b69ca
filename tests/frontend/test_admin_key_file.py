"""A generated admin key goes to a file only its user can read, and its path (never the key)
to the terminal and the logs; a key the user gave is written nowhere. Without Ray: the
deployment itself is replaced by fakes."""
from __future__ import annotations

import argparse
import logging
import os
import stat
import types

import pytest

from kvtier.actors import serve_graph
from kvtier.errors import ConfigError
from kvtier.frontend.admin_key_file import FILE_NAME, admin_key_dir, save_admin_key
from kvtier.cli.serve_command import add_arguments, main

GIVEN = "my-own-admin-key-0123456789"


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_the_key_file_is_readable_by_its_user_only(tmp_path):
    folder = tmp_path / "state" / "kvtier"
    path = save_admin_key("first-key-0123456789", folder)
    assert path == folder / FILE_NAME and path.read_text() == "first-key-0123456789\n"
    assert (mode(path), mode(folder)) == (0o600, 0o700)
    assert save_admin_key("second-key-0123456789", folder).read_text() == \
        "second-key-0123456789\n"  # a new start replaces it
    assert sorted(os.listdir(folder)) == [FILE_NAME]  # no temporary file left
    assert mode(path) == 0o600


def test_an_open_directory_of_the_users_is_closed_first(tmp_path):
    folder = tmp_path / "kvtier"
    folder.mkdir(mode=0o777)
    os.chmod(folder, 0o777)
    save_admin_key("a-key-0123456789abcdef", folder)
    assert mode(folder) == 0o700


def test_a_directory_of_someone_else_or_a_link_is_refused(tmp_path):
    if os.getuid() == 0:  # root can hand a directory to another user
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        os.chown(theirs, 54321, -1)
        with pytest.raises(ConfigError, match="belongs to user id 54321"):
            save_admin_key("a-key-0123456789abcdef", theirs)
        assert not (theirs / FILE_NAME).exists()
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    with pytest.raises(ConfigError, match="not a directory"):
        save_admin_key("a-key-0123456789abcdef", tmp_path / "link")
    assert not (real / FILE_NAME).exists()


def test_the_directory_follows_xdg_state_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert admin_key_dir() == tmp_path / "kvtier"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert admin_key_dir() == tmp_path / "home" / ".local" / "state" / "kvtier"


class _Forever:
    """`serve_forever`'s wait for Ctrl-C, over at once."""

    def set(self) -> None:
        pass

    def wait(self) -> None:
        pass


@pytest.fixture
def no_cluster(tmp_path, monkeypatch):
    """`kvtier serve` with the cluster faked, its state directory in tmp_path; what it
    started."""
    started = []
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(serve_graph, "start", lambda settings, *a: started.append(settings))
    monkeypatch.setattr(serve_graph, "stop", lambda joined=False: None)
    monkeypatch.setattr(serve_graph, "threading", types.SimpleNamespace(Event=_Forever))
    monkeypatch.setattr(serve_graph, "signal", types.SimpleNamespace(
        signal=lambda *a: None, SIGINT=None, SIGTERM=None))
    return started


def kvtier_serve(*flags: str) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert main(p.parse_args(["--model", "tiny", "--l3", "none", *flags])) == 0


def test_kvtier_serve_prints_where_a_generated_key_is_never_the_key(no_cluster, tmp_path,
                                                                      capsys, caplog):
    with caplog.at_level(logging.DEBUG):
        kvtier_serve()
    (settings,) = no_cluster
    path = tmp_path / "kvtier" / FILE_NAME
    assert path.read_text() == settings.admin_key + "\n" and mode(path) == 0o600
    printed = capsys.readouterr()
    assert str(path) in printed.out
    assert settings.admin_key not in printed.out + printed.err + caplog.text


def test_kvtier_serve_writes_a_given_key_nowhere(no_cluster, tmp_path, capsys, caplog):
    with caplog.at_level(logging.DEBUG):
        kvtier_serve("--admin-key", GIVEN)
    assert no_cluster[0].admin_key == GIVEN
    assert not (tmp_path / "kvtier").exists()
    printed = capsys.readouterr()
    assert GIVEN not in printed.out + printed.err + caplog.text


def test_a_serve_config_without_a_key_logs_the_path_not_the_key(tmp_path, monkeypatch,
                                                                caplog):
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    monkeypatch.setattr(serve_graph, "place", lambda settings, joined: settings)
    monkeypatch.setattr(serve_graph, "build_app", lambda settings: settings)
    with caplog.at_level(logging.DEBUG):
        settings = serve_graph.app_builder({"model": "tiny", "l3": "none"})
    path = tmp_path / "kvtier" / FILE_NAME
    assert path.read_text() == settings.admin_key + "\n" and mode(path) == 0o600
    assert str(path) in caplog.text and settings.admin_key not in caplog.text
    caplog.clear()
    given = serve_graph.app_builder({"model": "tiny", "l3": "none", "admin_key": GIVEN})
    assert given.admin_key == GIVEN and path.read_text() == settings.admin_key + "\n"
    assert GIVEN not in caplog.text
