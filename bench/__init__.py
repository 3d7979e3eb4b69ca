"""Benchmarks behind `kvtier bench ...`; each prints one JSON object with --json."""
from __future__ import annotations

import json


def emit(result: dict, as_json: bool) -> None:
    """Print a benchmark result: one JSON line, or aligned `key: value` lines for people."""
    if as_json:
        print(json.dumps(result))
        return
    for key, value in result.items():
        print(f"{key:>16}: {value}")
