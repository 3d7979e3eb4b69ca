"""Benchmarks behind `kvtier bench ...`; each prints one JSON object with --json."""
from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Iterator


def emit(result: dict, as_json: bool) -> None:
    """Print a benchmark result: one JSON line, or aligned `key: value` lines for people."""
    if as_json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>16}: {value}")


@contextlib.contextmanager
def stdout_to_stderr(active: bool) -> Iterator[None]:
    """File descriptor 1 pointed at stderr for the block, restored after: what Ray's driver
    and vLLM's processes print there stays out of the one JSON line of --json."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)

