"""`kvtier bench matrix`: workload builders, configurations and the report, on fakes (no model)."""
from __future__ import annotations

import json
import sys
import types
from typing import NamedTuple

import pytest

from kvtier.bench import matrix
from kvtier.bench.matrix_report import (TierSnapshot, make_cell, markdown_table, percentile,
                                        snapshot_diff, snapshot_sum, targets, tier_fractions,
                                        write_report)
from kvtier.bench.matrix_workloads import (QUICK, MatrixSizes, build_workloads, hicache_config,
                                           matrix_configs)
from kvtier.engine.request import pages_for
from kvtier.policies import PrefetchPolicy, StorageBackendKind, WritePolicy

TINY = MatrixSizes(page_size=16, chunk_tokens=64, system_tokens=64, document_tokens=128,
                   new_tokens=4, requests=3, instances=3, timeouts_s=(0.05, 0.5))


def encode(text: str) -> list[int]:
    return [ord(c) for c in text]  # one token per character: deterministic, no tokenizer


@pytest.fixture(scope="module")
def workloads():
    return {w.name: w for w in build_workloads(encode, TINY)}


def test_five_workloads_two_rounds(workloads):
    assert sorted(workloads) == list("ABCDE")
    for w in workloads.values():
        assert len(w.rounds) == 2 and all(w.rounds)
        assert {t.instance for r in w.rounds for t in r} == set(range(w.instances))
        longest = max(len(t.tokens) for r in w.rounds for t in r)
        assert pages_for(longest + TINY.new_tokens, TINY.page_size) <= w.device_pages


def test_shared_prefixes_are_whole_chunks(workloads):
    a = [t.tokens for r in workloads["A"].rounds for t in r]
    assert len(a) == 2 * TINY.requests and len(set(a)) == len(a)  # follow-ups are new prompts
    assert all(p[:TINY.system_tokens] == a[0][:TINY.system_tokens] for p in a)
    b = [t.tokens for r in workloads["B"].rounds for t in r]
    assert all(p[:TINY.document_tokens] == b[0][:TINY.document_tokens] for p in b)
    assert TINY.document_tokens % TINY.chunk_tokens == 0


def test_c_alternates_and_l1_cannot_hold_both(workloads):
    c = workloads["C"]
    docs = [t.tokens[:TINY.document_tokens] for t in c.rounds[0]]
    assert docs[0] != docs[1] and docs[0] == docs[2] and docs[1] == docs[3]
    assert c.device_pages < 2 * pages_for(TINY.document_tokens, TINY.page_size)


def test_d_spreads_one_document_over_instances(workloads):
    d = workloads["D"]
    assert d.instances == TINY.instances
    assert [t.instance for t in d.rounds[0]] == list(range(TINY.instances))
    assert len({t.tokens[:TINY.document_tokens] for r in d.rounds for t in r}) == 1


def test_e_shares_no_page(workloads):
    firsts = [t.tokens[:TINY.page_size] for r in workloads["E"].rounds for t in r]
    assert len(set(firsts)) == len(firsts)


def test_quick_sizes_build_with_a_real_shaped_encoder():
    ws = build_workloads(encode, QUICK)
    assert len(ws) == 5 and ws[3].instances == QUICK.instances


def test_configurations(tmp_path):
    cols = matrix_configs((0.05, 0.5))
    assert [c.config for c in cols] == [0, 1, 2, 3, 4, 5, 5]
    assert [c.key for c in cols][-2:] == ["5@0.05s", "5@0.5s"]
    cfg = {c.key: hicache_config(c, 64, str(tmp_path)) for c in cols}
    assert not cfg["0"].enable_hierarchical_cache and cfg["0"].storage_backend is None
    assert cfg["1"].write_policy is WritePolicy.WRITE_BACK and cfg["1"].storage_backend is None
    assert cfg["2"].write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
    assert cfg["3"].prefetch_policy is PrefetchPolicy.BEST_EFFORT
    assert cfg["4"].prefetch_policy is PrefetchPolicy.WAIT_COMPLETE
    assert cfg["4"].write_policy is WritePolicy.WRITE_THROUGH
    t = cfg["5@0.05s"]
    assert t.prefetch_policy is PrefetchPolicy.TIMEOUT
    assert t.storage_backend is StorageBackendKind.FILE
    assert t.prefetch_timeout_s(4096) == pytest.approx(0.05)


class FakeCached(NamedTuple):
    device: int
    host: int
    storage: int


class FakeOutput(NamedTuple):
    ttft_s: float
    decode_tokens_per_s: float
    cached: FakeCached
    prompt: tuple = (1,) * 100


def fake_cells() -> list[dict]:
    cells = []
    moved = TierSnapshot(100, 2_000_000, 0.001, 300, 4_000_000, 0.01, 0.002, 0.05)
    for w in "ABCDE":
        for config, timeout in [(0, None), (1, None), (2, None), (3, None), (4, None),
                                (5, 0.05), (5, 0.5)]:
            for rnd in (1, 2):
                ttft = (1.0 if rnd == 1 or config == 0 else 0.25) + 0.01 * config
                outs = [FakeOutput(ttft, 20.0, FakeCached(64, 128 * (rnd - 1), 0))] * 2
                cells.append(make_cell(w, config, rnd, outs, moved, 1000, timeout, "x"))
    return cells


def test_make_cell_and_snapshots():
    a, b = TierSnapshot(10, 20, 1.0), TierSnapshot(1, 2, 0.5)
    assert snapshot_diff(a, b) == TierSnapshot(9, 18, 0.5)
    assert snapshot_sum([a, b]).host_write_bytes == 11
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 0.9) == pytest.approx(9.1)
    outs = [FakeOutput(0.1, 10.0, FakeCached(64, 0, 0)),
            FakeOutput(0.3, 30.0, FakeCached(0, 0, 128))]
    cell = make_cell("B", 4, 2, outs, TierSnapshot(0, 5, 1.0, 7, 9, 1.0, 1.0, 0.2), 2000)
    assert cell["ttft_mean_s"] == pytest.approx(0.2) and cell["decode_tokens_per_s"] == 20.0
    assert cell["hit_tokens"] == {"device": 64, "host": 0, "storage": 128}
    assert cell["bytes_moved"] == {"device": 128000, "host": 5, "storage": 16}
    assert cell["prefetch_wait_s"] == pytest.approx(0.2)


def test_markdown_table_ratios():
    table = markdown_table(fake_cells(), 2)
    lines = table.splitlines()
    assert lines[0].startswith("| workload | cfg 0 | cfg 1 |") and "cfg 5@0.5s" in lines[0]
    assert len(lines) == 2 + 5
    assert "1000 ms (1.00×)" in lines[2] and "(0.26×)" in lines[2]


def test_targets_median_of_e_and_best_effort_against_cold():
    t = targets(fake_cells())
    # E: round 1 ratios 1.01..1.05 (config 5 twice), round 2 0.26..0.30: 12 cells.
    assert t["no_reuse_cells"] == 12 and t["no_reuse_median_ratio"] == pytest.approx(0.655)
    assert t["best_effort_vs_cold"] == {"A": 0.28, "B": 0.28, "D": 0.28}
    assert t["checks"] == {"no_reuse": True, "best_effort": True}
    slow = [dict(c, ttft_mean_s=2.0) if (c["workload"], c["config"], c["round"]) == ("B", 3, 2)
            else c for c in fake_cells()]
    assert targets(slow)["checks"]["best_effort"] is False
    assert targets([c for c in fake_cells() if c["workload"] != "E"])["checks"] == \
        {"no_reuse": None, "best_effort": True}  # not run: no verdict


def test_tier_fractions_pick_ceilings():
    f = tier_fractions(fake_cells(), {"memcpy_gb_s": 10.0, "file_read_gb_s": 2.0,
                                      "file_write_gb_s": 1.0})
    assert f["host_load"]["ceiling"] == "memcpy_gb_s" and f["host_load"]["fraction"] == 0.2
    assert f["storage_read"]["ceiling"] == "file_read_gb_s" and f["storage_read"]["fraction"] == 1.0
    assert tier_fractions(fake_cells(), {})["storage_write"]["fraction"] is None


def test_write_report_contract(tmp_path):
    result = {"cells": fake_cells(), "limits": {"memcpy_gb_s": 10.0},
              "crossover_tokens": {"host": 64, "storage": 512},
              "machine": matrix.machine(), "date": "2026-11-29T00:00:00+00:00", "quick": True}
    paths = write_report(tmp_path, result)
    for name in ("results.json", "results.md", "ttft_by_config.png", "hit_tokens_by_tier.png",
                 "bytes_moved.png"):
        assert (tmp_path / name) in paths and (tmp_path / name).stat().st_size > 0
    assert (tmp_path / "ttft_by_config.png").read_bytes()[:4] == b"\x89PNG"
    data = json.loads((tmp_path / "results.json").read_text())
    assert {"cells", "limits", "crossover_tokens", "machine", "date", "quick"} <= set(data)
    assert {"cores", "torch", "cuda"} <= set(data["machine"])
    assert len(data["cells"]) == 5 * 7 * 2
    for cell in data["cells"]:
        assert {"workload", "config", "round", "ttft_mean_s", "ttft_p90_s", "decode_tokens_per_s",
                "hit_tokens", "bytes_moved", "prefetch_wait_s", "timeout_s"} <= set(cell)
        assert set(cell["hit_tokens"]) == set(cell["bytes_moved"]) == {"device", "host", "storage"}
        assert not any(k.startswith("_") for k in cell)
    assert {c["timeout_s"] for c in data["cells"] if c["config"] == 5} == {0.05, 0.5}
    md = (tmp_path / "results.md").read_text()
    assert "| A |" in md and "(1.00×)" in md and "memcpy_gb_s" in md and "## Targets" in md
    assert data["targets"]["checks"] == {"no_reuse": True, "best_effort": True}


def test_ceilings_call_the_other_modules(monkeypatch, tmp_path):
    calls = []

    class Limits(NamedTuple):
        memcpy_gb_s: float = 11.0

        def to_json(self):
            return self._asdict()

    class Crossover(NamedTuple):
        host_tokens: int = 32
        storage_tokens: int = 256

        def to_json(self):
            return self._asdict()

    fakes = {
        "kvtier.bench.limits": {"measure_limits":
                                lambda d, q: calls.append(("l", d, q)) or Limits()},
        "kvtier.bench.crossover": {"measure_crossover":
                                   lambda q, dt: calls.append(("c", q, dt)) or Crossover()},
        "kvtier.calibration": {"save_calibration": lambda c: calls.append(("s", c))},
    }
    for name, attrs in fakes.items():
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**attrs))
    limits, tokens, cross = matrix.measure_ceilings(str(tmp_path), True, "bf16")
    assert limits == {"memcpy_gb_s": 11.0} and tokens == {"host": 32, "storage": 256}
    assert cross["storage_tokens"] == 256
    assert [c[0] for c in calls] == ["l", "c", "s"] and calls[0][1:] == (str(tmp_path), True)


def test_cli_parses_matrix():
    from kvtier.cli.main import build_parser

    ns = build_parser().parse_args(["bench", "matrix", "--quick", "--out", "/tmp/x", "--json",
                                    "--skip-limits"])
    assert ns.quick and ns.json and ns.skip_limits and ns.out == "/tmp/x"
    assert ns.func is matrix.main


def test_turn_order_rotates_so_no_configuration_always_runs_first():
    orders = [matrix.turn_order(3, step) for step in range(4)]
    assert orders == [[0, 1, 2], [1, 2, 0], [2, 0, 1], [0, 1, 2]]
    assert all(sorted(o) == [0, 1, 2] for o in orders)


def test_run_workload_runs_configurations_side_by_side(tmp_path, monkeypatch):
    """Two cells per configuration, in configuration then round order; turn t of every
    configuration runs before turn t + 1 of any; each configuration keeps its own caches and
    L3 directory (D's instances 1 and 2 hit what instance 0 stored, in L3 columns only)."""
    import torch

    from kvtier.engine import load_tiny_model
    from kvtier.engine.engine import Engine

    model = load_tiny_model(torch.float32, "cpu")
    sizes = TINY._replace(document_tokens=256)  # the prefetch threshold's 256 tokens
    configs = matrix_configs(sizes.timeouts_s)
    d = {w.name: w for w in build_workloads(encode, sizes)}["D"]
    ran = []
    real_generate = Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompts, sampling:
                        ran.append(tuple(prompts[0])) or real_generate(self, prompts, sampling))
    cells = matrix.run_workload(model, None, d, configs, sizes, str(tmp_path))
    assert [(c["config"], c["timeout_s"], c["round"]) for c in cells] == [
        (c.config, c.timeout_s, r) for c in configs for r in (1, 2)]
    turns = [t.tokens for r in d.rounds for t in r]
    assert ran == [t for t in turns for _ in configs]  # turn by turn, every column each turn
    r1 = {(c["config"], c["timeout_s"]): c for c in cells if c["round"] == 1}
    assert r1[(0, None)]["hit_tokens"]["storage"] == 0
    assert r1[(4, None)]["hit_tokens"]["storage"] == 2 * sizes.document_tokens
    assert all(c["requests"] == sizes.instances and c["load_avg_1m"] >= 0 for c in cells)


def test_side_by_side_groups_fit_the_memory_budget(workloads):
    assert matrix.side_by_side([3, 3, 3], None) == [[0, 1, 2]]
    assert matrix.side_by_side([3, 3, 3], 9) == [[0, 1, 2]]
    assert matrix.side_by_side([3, 3, 3], 6) == [[0, 1], [2]]
    assert matrix.side_by_side([5, 3, 3], 4) == [[0], [1], [2]]  # too big alone still runs
    cols = matrix_configs(TINY.timeouts_s)
    e = workloads["E"]
    need = [matrix.pool_bytes(e, c, TINY, 1000) for c in cols]
    assert need[0] == e.device_pages * 1000  # L1 only
    assert need[1:] == [3 * e.device_pages * 1000] * 6  # L1 + L2 of twice its size


def test_a_model_directory(tmp_path):
    """--model DIR: the quick matrix on a tiny random Llama directory; the ceilings and the
    crossover calibrate SmolLM2, so they need --skip-limits."""
    pytest.importorskip("transformers")
    from tiny_llama import make_checkpoint

    from kvtier.cli.main import build_parser
    from kvtier.errors import ConfigError

    model_dir = make_checkpoint(tmp_path / "tiny-llama")
    argv = ["bench", "matrix", "--quick", "--out", str(tmp_path / "out"), "--model",
            str(model_dir), "--workloads", "AE", "--configs", "03", "--dtype", "fp32", "--json"]
    with pytest.raises(ConfigError, match="add --skip-limits"):
        matrix.main(build_parser().parse_args(argv))
    params = matrix.MatrixParams(str(tmp_path / "out"), True, "fp32", "AE", (0, 3), True, False,
                                 None, str(model_dir))
    result = matrix.run(params)
    assert result["model"].startswith("tiny-llama-")  # the directory's name and weights digest
    assert len(result["cells"]) == 2 * 2 * 2  # workloads x configurations x rounds
