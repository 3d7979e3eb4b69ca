"""Settings for the whole test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# One OpenMP thread per process unless the environment chooses: the suite runs many processes
# at once (Ray workers, TP ranks, servers, the hosts' drivers) on few cores, and torch's
# default of a thread per core made them spin against each other: on two busy cores
# test_engine_smollm2.py took 85 s instead of 250 s with it (its batched-greedy test 26 s
# instead of 131 s), tests/engine 296 s instead of 434 s. Ray gives its workers one thread
# already, so a reference computed here now runs as the ranks it is compared with do.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_exit_status: list[int] = []

HERE = Path(__file__).parent
# `make test` runs the suite on two pytest-xdist workers (`-n 2`): each directory of tests/ is
# one unit of work, run whole and in order on one worker (`pytest_xdist_make_scheduler`), so
# that a directory's shared cluster (tests/actors/conftest.py, tests/frontend/shared_serve.py)
# starts once and its modules keep the order they rely on. Most tests wait on processes,
# deadlines and sockets more than they compute, so two directories at a time fill the two
# cores. The directories are handed out longest first (seconds of a serial run, rounded), so
# that no long one starts last while the other worker idles. Tests bind only ports of their
# own directory's (or free ones). `make test` runs tests/hosts afterwards, alone: its link
# cuts and node deaths race Ray's health checks, and once, next to another directory's load,
# a rank replacement there missed its 120-s window.
GROUP_SECONDS = {"actors": 370, "frontend": 270, "bench": 190, "connector": 250, "engine": 110,
                 "backends": 110, "vllm_engine": 390, "tiers": 15, "hosts": 230}
TOP = "top"  # the modules directly under tests/: a few seconds


def _group(nodeid: str) -> str:
    """The directory of tests/ a test is in (`TOP` for tests/*.py)."""
    parts = nodeid.split("::", 1)[0].split("/")
    return parts[1] if len(parts) > 2 and parts[0] == HERE.name else TOP


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, the directories longest first (`GROUP_SECONDS`); each keeps its order.
    A serial run keeps pytest's order."""
    if config.getoption("numprocesses", None):
        items.sort(key=lambda item: -GROUP_SECONDS.get(_group(item.nodeid), 0))


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """Under `-n N`: a directory at a time per worker, in collection order."""
    from xdist.scheduler import LoadScopeScheduling

    class DirectoryScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    config.option.loadscopereorder = False  # collection order: longest first
    return DirectoryScheduling(config, log)


def pytest_sessionfinish(session, exitstatus) -> None:
    _exit_status.append(int(exitstatus))


def pytest_unconfigure(config) -> None:
    """End the process at once when tests left parked Mooncake clients (clients whose master
    a test killed: kvtier.backends.mooncake_backend.close_client): Mooncake tears each down
    at exit by retrying its gone master, and a full run spent about a minute on that after
    its last test. Everything a test owns was closed by its fixtures; the report is out."""
    import sys

    backend = sys.modules.get("kvtier.backends.mooncake_backend")
    if backend is None or not backend.PARKED_CLIENTS or not _exit_status:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status[-1])
