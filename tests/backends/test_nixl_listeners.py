"""NIXL's agent (POSIX plugin, local transfers) opens no listening socket: checked in a fresh
process, so no other test's sockets are counted."""
from __future__ import annotations

import os
import subprocess
import sys

HERE = os.path.dirname(__file__)


def test_a_nixl_backend_listens_on_nothing():
    out = subprocess.run([sys.executable, os.path.join(HERE, "nixl_listen_probe.py")],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    lines = out.strip().splitlines()
    assert lines[-2] == "[True, True] [True, True]"  # it did move pages
    assert lines[-1] == "[]", lines[-1]
