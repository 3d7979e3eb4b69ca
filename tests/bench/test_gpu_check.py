"""scripts/gpu_check.sh as a GPU machine runs it, here on the CPU: kvtier imported from the
checkout (not the installed package), one JSON line, the L2 hit equal to the cold run."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)


def test_the_gpu_check_prints_one_json_line_and_passes_on_cpu(tmp_path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "KVTIER_GPU_CHECK_TIMEOUT_S": "100"}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=110)
    lines = proc.stdout.splitlines()
    assert len(lines) == 1, f"stdout: {proc.stdout!r}\nstderr: {proc.stderr[-2000:]}"
    result = json.loads(lines[0])
    assert proc.returncode == 0 and result["ok"], result
    assert result["cuda"] is torch.cuda.is_available()
    assert result["torch"] == torch.__version__
    transfer = result["transfer"]
    assert transfer["plain_copy_gbps"] > 0 and transfer["load_gbps"] > 0
    assert transfer["load_ratio"] == transfer["layouts"]["page_first"]["load_ratio"]
    hit = result["l2_hit"]
    assert result["l2_hit_equal_cold"] is True and hit["tokens_equal"] and hit["logits_equal"]
    assert hit["cold_cached_tokens"] == 0 and hit["hit_l1_tokens"] == 0
    assert hit["hit_l2_tokens"] == 64 and hit["l2_load_bytes"] > 0  # 4 pages loaded back


def test_a_python_without_torch_gets_a_json_answer_too(tmp_path) -> None:
    bare = tmp_path / "python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S -I \"$@\"\n")  # no site-packages
    bare.chmod(0o755)
    env = {**os.environ, "PYTHON": str(bare)}
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    result = json.loads(proc.stdout)
    assert proc.returncode == 1 and result["ok"] is False
    assert "No module named 'torch'" in result["error"] and "needs torch" in result["error"]
