"""The command line: benchmarks print their JSON contracts (no timing assertions)."""
import json

import pytest

from kvtier.bench.trace import TraceError, read_trace
from kvtier.cli.main import main


def run_json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def trace_file(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    assert main(["bench", "gen-trace", "--out", str(path), "--conversations", "12",
                 "--turns", "3", "--slots", "4", "--system-tokens", "128"]) == 0
    capsys.readouterr()
    return path


def test_gen_trace_structure(trace_file):
    trace = read_trace(trace_file)
    assert len(trace.requests) == 36
    by_conv = {}
    for r in trace.requests:
        prev = by_conv.get(r.conv)
        if prev is not None:  # a turn's prompt extends the previous turn's prompt + output
            assert r.turn == prev.turn + 1
            assert r.prompt[: len(prev.prompt) + 1] == prev.prompt + (prev.output,)
        by_conv[r.conv] = r


def test_bench_tree_json_contract(trace_file, capsys):
    out = run_json(capsys, ["bench", "tree", "--trace", str(trace_file), "--page-size", "16",
                            "--capacity", "4096", "--depth", "2", "--json"])
    assert out["requests"] == 36 and 0 < out["hit_rate"] < 1
    assert out["requests_per_s"] > 0
    for key in ("match_us", "insert_us", "evict_us"):
        assert set(out[key]) >= {"mean", "p50", "p99"}


def test_bad_trace_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"type":"segment","id":0,"tokens":[1]}\n')
    with pytest.raises(TraceError, match="no header"):
        read_trace(bad)
    bad.write_text('{"type":"header","version":1}\n{"type":"request","id":0,"conv":0,"turn":0,"prompt":[5],"output":6}\n')
    with pytest.raises(TraceError, match="unknown segments"):
        read_trace(bad)
