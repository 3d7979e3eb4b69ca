"""Settings for the whole test session."""
from __future__ import annotations

import os

# One OpenMP thread per process unless the environment chooses: the suite runs many processes
# at once (Ray workers, TP ranks, servers, the hosts' drivers) on few cores, and torch's
# default of a thread per core made them spin against each other: on two busy cores
# test_engine_smollm2.py took 85 s instead of 250 s with it (its batched-greedy test 26 s
# instead of 131 s), tests/engine 296 s instead of 434 s. Ray gives its workers one thread
# already, so a reference computed here now runs as the ranks it is compared with do.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_exit_status: list[int] = []


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
