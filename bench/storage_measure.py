"""What the storage benches (`storage_file`, `storage_nixl`, `storage_mooncake`) share:
timing and the report.

Each bench measures kvtier's backend twice, with `verify_checksums` on (the default) and
off, against the raw I/O it is built on, and reports (`report`):
- GB/s and kvtier's share of raw: `write_gbps`, `read_gbps`, `write_ratio`, `read_ratio`
  are the default, verified configuration's (the issue's target is ratio >= 0.8);
  `unverified_*` the same figures with verification off; `raw_*_gbps` raw's own.
- `objects`, per side (`raw`, `kvtier_verified`, `kvtier_unverified`), what one batch of
  all the pages moves: `objects_per_page`, `bytes_per_object` (what one object's write
  stores: kvtier's include the object header), `write_calls_per_batch` and
  `read_calls_per_batch` (each bench says what it counts as a call), and
  `write_objects_per_s` / `read_objects_per_s` at the reported speed. The names are the
  Mooncake bench's (`storage_mooncake`), whose `kvtier_verified` means the same.
"""
from __future__ import annotations

import time
from typing import Callable, NamedTuple

# The sides a bench times, by the short names of its timing keys (`raw_w`, `kv_r`, ...),
# and their names in the report's `objects`.
SIDES = {"raw": "raw", "kv": "kvtier_verified", "kvu": "kvtier_unverified"}
VERIFY = {"kv": True, "kvu": False}  # kvtier's sides: their verify_checksums


class BatchShape(NamedTuple):
    """What one batch of every page moves on one side, and in how many calls."""

    objects: int  # objects one batch writes (and reads back)
    bytes_per_object: int  # bytes one object's write stores
    write_calls: int
    read_calls: int


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn()` took (perf_counter)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def rotated(sides: list[str], by: int) -> list[str]:
    """`sides` starting at index `by` (mod their count): each goes first as often."""
    by %= len(sides)
    return sides[by:] + sides[:by]


def report(seconds: dict[str, float], total_bytes: int, pages: int,
           shapes: dict[str, BatchShape]) -> dict:
    """The figures of the module docstring from the best seconds of one batch of `pages`
    pages (`total_bytes` of KV) per side and phase: keys `raw_w`, `raw_r`, `kv_w`, ... of
    SIDES; `shapes` by side."""
    gbps = {op: total_bytes / s / 1e9 for op, s in seconds.items()}
    return {
        **bandwidth(gbps["kv_w"], gbps["kv_r"], gbps["raw_w"], gbps["raw_r"]),
        **bandwidth(gbps["kvu_w"], gbps["kvu_r"], gbps["raw_w"], gbps["raw_r"],
                     prefix="unverified_"),
        "objects": {name: per_object(shapes[side], pages, seconds[f"{side}_w"],
                                      seconds[f"{side}_r"])
                    for side, name in SIDES.items()},
    }


def bandwidth(write: float, read: float, raw_write: float, raw_read: float,
               prefix: str = "") -> dict:
    """kvtier's GB/s and their ratios to raw's, rounded (computed from the unrounded figures),
    named with `prefix`; raw's own GB/s come along only without one."""
    out = {f"{prefix}write_gbps": round(write, 3), f"{prefix}read_gbps": round(read, 3)}
    if not prefix:
        out.update(raw_write_gbps=round(raw_write, 3), raw_read_gbps=round(raw_read, 3))
    out.update({f"{prefix}write_ratio": round(write / raw_write, 3),
                f"{prefix}read_ratio": round(read / raw_read, 3)})
    return out


def per_object(shape: BatchShape, pages: int, write_s: float, read_s: float) -> dict:
    return {"objects_per_page": shape.objects // pages,
            "bytes_per_object": shape.bytes_per_object,
            "write_calls_per_batch": shape.write_calls,
            "read_calls_per_batch": shape.read_calls,
            "write_objects_per_s": round(shape.objects / write_s),
            "read_objects_per_s": round(shape.objects / read_s)}
