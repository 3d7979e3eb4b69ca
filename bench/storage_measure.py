"""What the storage benches (`storage_file`, `storage_nixl`) share: timing and the report.

Each bench measures kvtier's backend against the raw I/O it is built on; both report
bandwidth in GB/s and kvtier's share of raw (`*_ratio`; the issue's target is >= 0.8).
"""
from __future__ import annotations

import time
from typing import Callable


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn()` took (perf_counter)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bandwidth_report(write: float, read: float, raw_write: float, raw_read: float) -> dict:
    """kvtier's and raw GB/s and their ratios, rounded; computed from the unrounded figures."""
    return {
        "write_gbps": round(write, 3),
        "read_gbps": round(read, 3),
        "raw_write_gbps": round(raw_write, 3),
        "raw_read_gbps": round(raw_read, 3),
        "write_ratio": round(write / raw_write, 3),
        "read_ratio": round(read / raw_read, 3),
    }
