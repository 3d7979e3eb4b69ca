"""Which instances are stepping: the router's own deadline for an instance that stopped.

Ray declares a node dead only when its heartbeats have been missing for tens of seconds. A
link cut for a few seconds, or a rank stuck in a step, leaves the instance alive to Ray while
its requests wait. So the router keeps a deadline of its own, from what it polls: an instance
is STALLED when it has work and has completed no step for `stall_timeout_s`, or when none of
its polls has been answered for that long (a cut link: the router cannot tell whether it has
work). An idle instance that answers is LIVE however long ago it stepped. A stalled instance
is LIVE again as soon as a poll shows a new step, or shows it idle. An instance that answers
its polls while it replaces its rank actors (a rank died: it recomputes its requests on a
fresh set) is RECOVERING once that takes longer than the deadline: not chosen, and its
requests move where another instance is live, but with no other one they wait for it
(its own restart limit ends a recovery that keeps failing), never a stall's 503.

An instance's deadline starts when the router first asks about it (when polling starts), not
when the router is built: Serve may build it long before the first request.

Only the router's own monotonic clock is compared: an instance reports how many steps it has
completed, not when, so the hosts need no common clock.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, NamedTuple

from kvtier.policies import _Choice

log = logging.getLogger(__name__)


class InstanceState(_Choice):
    LIVE = "live"
    STALLED = "stalled"
    RECOVERING = "recovering"  # quiet past the deadline, replacing its ranks


class LivenessView(NamedTuple):
    """One instance as the deadline sees it (the router's `status` shows it)."""

    state: InstanceState
    quiet_s: float  # seconds since it last stepped, was idle, or answered, whichever counts
    stalls: int  # times it went from live to stalled


@dataclass
class _Track:
    answered_s: float  # the last poll answered
    progress_s: float  # the last poll that showed a new step, or no work
    steps: int = -1
    busy: bool = False
    recovering: bool = False  # the last answered poll said it replaces its ranks
    state: InstanceState = InstanceState.LIVE
    stalls: int = 0


class Liveness:
    """Per-instance deadlines: `answered` / `unanswered` after each poll, `state` any time."""

    def __init__(self, names: Iterable[str], stall_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_timeout_s, self._clock = stall_timeout_s, clock
        self._names = tuple(names)
        self._tracks: dict[str, _Track] = {}

    def answered(self, name: str, steps: int, busy: bool,
                 recovering: bool = False) -> InstanceState:
        """A poll came back: `steps` completed so far, `busy` = requests queued or running,
        `recovering` = it is replacing its ranks."""
        track, now = self._track(name), self._clock()
        track.answered_s = now
        if steps != track.steps or not busy:
            track.progress_s = now
        track.steps, track.busy, track.recovering = steps, busy, recovering
        return self.state(name)

    def unanswered(self, name: str) -> InstanceState:
        """A poll failed or timed out: nothing is learned, the deadline keeps running."""
        return self.state(name)

    def state(self, name: str) -> InstanceState:
        """LIVE, STALLED or RECOVERING now (a change is counted and logged here)."""
        track = self._track(name)
        quiet_s = self._quiet_s(track)
        answering = self._clock() - track.answered_s < self.stall_timeout_s
        state = InstanceState.LIVE
        if quiet_s >= self.stall_timeout_s:
            state = InstanceState.RECOVERING if track.recovering and answering \
                else InstanceState.STALLED
        if state is not track.state:
            track.state = state
            if state is InstanceState.STALLED:
                track.stalls += 1
                log.warning("instance %s stalled: %s for %.1f s; routing around it", name,
                            "no step with work waiting" if answering else "no poll answered",
                            quiet_s)
            elif state is InstanceState.RECOVERING:
                log.warning("instance %s is replacing its ranks (%.1f s without a step); "
                            "routing around it", name, quiet_s)
            else:
                log.warning("instance %s steps again; routing to it again", name)
        return state

    def view(self, name: str) -> LivenessView:
        state = self.state(name)
        track = self._track(name)
        return LivenessView(state, self._quiet_s(track), track.stalls)

    def live(self) -> set[str]:
        return {name for name in self._names if self.state(name) is InstanceState.LIVE}

    def _track(self, name: str) -> _Track:
        if name not in self._tracks:  # one deadline's grace from the first question
            if name not in self._names:
                raise KeyError(f"no instance {name!r} (known: {', '.join(self._names)})")
            now = self._clock()
            self._tracks[name] = _Track(now, now)
        return self._tracks[name]

    def _quiet_s(self, track: _Track) -> float:
        # progress is only seen in an answer, so a busy instance's progress_s <= answered_s
        return self._clock() - (track.progress_s if track.busy else track.answered_s)


def candidates(loads: Mapping[str, int], excluded: Iterable[str]) -> dict[str, int]:
    """The instances a request may go to: every one not excluded (broken, stalled, or the one
    it is leaving), with its load."""
    skip = set(excluded)
    return {name: load for name, load in loads.items() if name not in skip}
