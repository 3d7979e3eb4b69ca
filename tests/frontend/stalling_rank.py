"""A rank actor that stops stepping on request: the stall tests' subclass of Rank.

The test writes `stall_file(pid)` (how many more steps to take, and for how long to sleep
then); the first rank that steps after that claims the file (a rename: exactly one rank
does) and sleeps in its step as told, as a rank behind a cut link would hang. Ranks with no
work do not step, so the rank that claims it is the one serving the test's request. Ray
workers cannot import this file (tests/ is not installed), so the class travels pickled by
value, and with it the driver's pid, which names the file.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import tempfile
import time
from typing import Iterator

import ray.cloudpickle

from kvtier.actors.rank_actor import Rank
from kvtier.frontend.settings import ServeSettings

log = logging.getLogger(__name__)

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

DRIVER_PID = os.getpid()


def stall_file(pid: int = DRIVER_PID) -> str:
    return os.path.join(tempfile.gettempdir(), f"kvtier-stall-test-{pid}.json")


def arm_stall(after_steps: int, seconds: float) -> None:
    """The next rank to step takes `after_steps` more steps, then sleeps `seconds` in one."""
    tmp = stall_file() + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"after_steps": after_steps, "seconds": seconds}, f)
    os.replace(tmp, stall_file())


class StallingRank(Rank):
    _stall: tuple[int, float] | None = None  # (at this step, sleep this long)

    def step(self) -> bytes:
        if self._stall is None:
            self._claim()
        if self._stall is not None and self.steps >= self._stall[0]:
            seconds, self._stall = self._stall[1], None
            log.warning("rank %d: not stepping for %.1f s (injected)", self.rank, seconds)
            time.sleep(seconds)
        return super().step()

    def _claim(self) -> None:
        claimed = f"{stall_file()}.{os.getpid()}"
        try:
            os.rename(stall_file(), claimed)
        except FileNotFoundError:
            return  # not armed, or another rank claimed it
        with open(claimed) as f:
            order = json.load(f)
        os.remove(claimed)
        self._stall = (self.steps + order["after_steps"], order["seconds"])


@contextlib.contextmanager
def served_stalling(settings: ServeSettings) -> Iterator[None]:
    """The graph of `settings` on the shared cluster (tests/frontend/shared_serve.py) with
    ranks that stall when armed; a stall no rank claimed is disarmed afterwards."""
    from shared_serve import served

    try:
        with served(settings, rank_class=StallingRank):
            yield
    finally:
        if os.path.exists(stall_file()):
            os.remove(stall_file())
