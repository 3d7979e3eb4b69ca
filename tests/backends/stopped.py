"""Stopping a test's peer process (SIGSTOP) and knowing it stopped: the signal stops its
threads asynchronously, and a transport thread still running can answer one more call (a
read from a "stopped" Mooncake peer completed, twice in CI)."""
from __future__ import annotations

import os
import signal
import time


def sigstop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once every one of its threads is stopped."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not all(_state(pid, task) in ("T", "t", "") for task in os.listdir(f"/proc/{pid}/task")):
        assert time.monotonic() < deadline, f"the threads of process {pid} did not all stop"
        time.sleep(0.001)


def _state(pid: int, task: str) -> str:
    """One thread's state letter from /proc ('' when it is gone)."""
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""
