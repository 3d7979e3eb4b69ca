"""The bound of a deployment's file or nixl L3 (`l3_max_gb`): a size, `auto` or `unbounded`.

Why a default bound: client traffic writes L3 pages for as long as the deployment serves, so
an unbounded file L3 fills its disk (and with it whatever shares the disk: Ray's object
spilling under /tmp, logs, converted model weights). `auto`, the default, bounds the namespace
at AUTO_DISK_SHARE of the space free where the L3 root lives, measured once when the
deployment starts (every instance registers the same bound: a namespace registered twice must
be the same spec) and printed by `kvtier serve`. A size in GiB sets it; `unbounded` (or 0, its
spelling before `auto` existed) has no bound, only when asked. Past the bound the namespace
evicts its least recently used pages (tiers/page_directory), so a bound costs hits, never
answers. Mooncake's master bounds its own store: a size is refused there, auto does nothing.
"""
from __future__ import annotations

import logging
import math
import os
import shutil
from typing import Any

from kvtier.errors import ConfigError
from kvtier.policies import _Choice

log = logging.getLogger(__name__)

# Half of what is free: what shares the disk keeps as much room as L3 takes, and a second
# deployment started on the same disk takes half of what is left, so together they never
# fill it. A smaller share only lowers the hit rate of old prefixes (eviction is LRU).
AUTO_DISK_SHARE = 0.5
MIN_AUTO_BYTES = 64 << 20  # a nearly full disk still gets a bound that holds a few pages
MAX_GB = 1e6
GiB = 1 << 30


class L3Bound(_Choice):
    """A bound that is not a size."""

    AUTO = "auto"  # AUTO_DISK_SHARE of the disk space free where l3_root lives, at start
    UNBOUNDED = "unbounded"  # no bound: the namespace grows until the disk is full


def parse_l3_max_gb(value: Any) -> float | L3Bound:
    """`l3_max_gb` as a Serve config or a flag gives it: a number of GiB (> 0; 0 is
    'unbounded', as it always meant), 'auto' or 'unbounded' (a flag's text too)."""
    if isinstance(value, L3Bound):
        return value
    if isinstance(value, str):
        try:
            return L3Bound.parse(value, "l3_max_gb")
        except ConfigError:
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"l3_max_gb: {value!r} is not a size in GiB, 'auto' or "
                                  "'unbounded'") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or not 0 <= value <= MAX_GB:
        raise ConfigError(f"l3_max_gb: expected a size in GiB between 0 and {MAX_GB:g}, "
                          f"'auto' or 'unbounded', got {value!r}")
    return L3Bound.UNBOUNDED if value == 0 else float(value)


def free_bytes_at(path: str) -> int:
    """Free bytes of the filesystem that holds `path` (or, before it exists, its nearest
    existing parent: where it will be made)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return shutil.disk_usage(path).free


def auto_l3_gb(root: str, free_bytes: int | None = None) -> float:
    """The `auto` bound in GiB for an L3 root: AUTO_DISK_SHARE of the space free there
    (`free_bytes`: measured now when None)."""
    free = free_bytes_at(root) if free_bytes is None else free_bytes
    bound = int(free * AUTO_DISK_SHARE)
    if bound < MIN_AUTO_BYTES:
        log.warning("the disk holding the L3 root %s has %.1f MiB free; bounding L3 at %d MiB "
                    "(free some space, or give l3_max_gb)", root, free / (1 << 20),
                    MIN_AUTO_BYTES >> 20)
        bound = MIN_AUTO_BYTES
    return bound / GiB


def describe_l3_bound(asked: float | L3Bound, bound: float | L3Bound, root: str) -> str:
    """One line for the start of `kvtier serve`: the bound `asked` for, what it came to
    (`bound`: `asked` resolved) and how to change it."""
    if bound is L3Bound.UNBOUNDED:
        return (f"L3 at {root} is unbounded, as asked: it grows until the disk is full "
                "(--l3-max-gb GIB bounds it)")
    if not isinstance(bound, float):
        return f"L3 at {root}: bounded when it is attached (--l3-max-gb GIB or unbounded)"
    if asked is L3Bound.AUTO:
        return (f"L3 at {root} is bounded at {bound:.2f} GiB, {AUTO_DISK_SHARE:.0%} of the "
                f"disk space free there at start; past it the least recently used pages go "
                f"(--l3-max-gb GIB to choose, --l3-max-gb unbounded for no bound)")
    return (f"L3 at {root} is bounded at {bound:g} GiB; past it the least recently used pages "
            f"go (--l3-max-gb)")
