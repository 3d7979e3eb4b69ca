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
