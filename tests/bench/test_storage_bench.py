"""`kvtier bench storage --backend file|nixl --json` as a user runs it, on a few pages: kvtier
with and without verification beside raw, and per-object figures that agree with the GB/s."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvtier.backends.file_object import HEADER_BYTES

pytestmark = pytest.mark.timeout(120)

PAGES = 4
KV_HEADS = 3  # SmolLM2-135M, the bench's model
SIDES = ("raw", "kvtier_verified", "kvtier_unverified")
PER_OBJECT = {"objects_per_page", "bytes_per_object", "write_calls_per_batch",
              "read_calls_per_batch", "write_objects_per_s", "read_objects_per_s"}
# the GB/s of each side: (write, read)
GBPS = {"raw": ("raw_write_gbps", "raw_read_gbps"),
        "kvtier_verified": ("write_gbps", "read_gbps"),
        "kvtier_unverified": ("unverified_write_gbps", "unverified_read_gbps")}


def bench(backend: str, tmp_path) -> dict:
    proc = subprocess.run([sys.executable, "-m", "kvtier", "bench", "storage", "--backend", backend,
                           "--pages", str(PAGES), "--root-dir", str(tmp_path), "--json"],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)  # all of stdout: no library's log line mixed in


@pytest.mark.parametrize("backend", ["file", "nixl"])
def test_bench_storage_reports_both_kvtier_configurations_and_per_object_figures(backend,
                                                                                 tmp_path):
    if backend == "nixl":
        pytest.importorskip("nixl")
    out = bench(backend, tmp_path)
    assert out["backend"] == backend and out["pages"] == PAGES
    for prefix in ("", "unverified_"):  # ratios are kvtier over raw, from unrounded GB/s
        for op in ("write", "read"):
            ratio = out[f"{prefix}{op}_gbps"] / out[f"raw_{op}_gbps"]
            assert out[f"{prefix}{op}_ratio"] == pytest.approx(ratio, rel=0.02, abs=0.002)
    objects = out["objects"]
    assert set(objects) == set(SIDES)
    payload = out["page_bytes"] // (2 * KV_HEADS)
    for side in SIDES:
        o = objects[side]
        assert set(o) == PER_OBJECT
        assert o["objects_per_page"] == 2 * KV_HEADS  # one per KV head and part
        assert o["bytes_per_object"] == payload + (0 if side == "raw" else HEADER_BYTES)
        for op, key in zip(("write", "read"), GBPS[side]):  # objects/s agree with the GB/s
            per_s = out[key] * 1e9 / out["page_bytes"] * o["objects_per_page"]
            assert o[f"{op}_objects_per_s"] == pytest.approx(per_s, rel=0.02, abs=2)
    calls = {side: (objects[side]["write_calls_per_batch"], objects[side]["read_calls_per_batch"])
             for side in SIDES}
    assert calls["kvtier_verified"] == calls["kvtier_unverified"]  # verifying adds no I/O
    objects_per_batch = PAGES * 2 * KV_HEADS
    if backend == "nixl":  # one NIXL request per batch each way
        assert calls["raw"] == calls["kvtier_verified"] == (1, 1)
    else:  # I/O calls: raw open/write|readinto/close; kvtier reads open/readv/close
        assert calls["raw"] == (3 * objects_per_batch, 3 * objects_per_batch)
        writes, reads = calls["kvtier_verified"]
        assert reads == 3 * objects_per_batch
        # stat, open, writev, close, link, unlink each; once: the directories (path-deep)
        assert 6 * objects_per_batch <= writes <= 6 * objects_per_batch + 40
    assert list(tmp_path.iterdir()) == []  # cleaned up after itself
