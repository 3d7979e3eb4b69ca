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


SHARED = ("--model", "--dtype", "--tp", "--l3", "--l3-root", "--pd-transport", "--schedule-policy")


def _commands(parser, path=()):
    """(command words, parser) for every leaf command under `parser`."""
    import argparse

    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        yield path, parser
    for sub in subs:
        for name, child in sub.choices.items():
            yield from _commands(child, (*path, name))


def test_shared_flags_are_declared_only_by_their_builders():
    """--model, --dtype, --tp, --l3, --l3-root, --pd-transport and --schedule-policy: one
    declaration each, in cli/shared_flags.py."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    declared = re.compile(r"add_argument\(\s*[\"'](%s)[\"']" % "|".join(map(re.escape, SHARED)))
    places = [f"{path.relative_to(root)}:{m.group(1)}"
              for folder in ("kvtier", "cli", "bench", "hosts")
              for path in sorted((root / folder).rglob("*.py"))
              for m in declared.finditer(path.read_text())]
    assert sorted(places) == sorted(f"cli/shared_flags.py:{flag}" for flag in SHARED)


def test_every_command_takes_the_one_list_of_choices():
    """A command's --dtype / --l3 choices are the vocabulary's, or a subset of it (bench
    transfer's KV page dtype excepted: no model, so no auto, and fp16)."""
    from kvtier.cli.main import build_parser
    from kvtier.dtypes import DType
    from kvtier.frontend.settings import L3_NONE
    from kvtier.policies import StorageBackendKind

    seen = {}
    for words, parser in _commands(build_parser()):
        for action in parser._actions:
            flag = next((s for s in action.option_strings if s in ("--dtype", "--l3")), None)
            if flag is None:
                continue
            seen[(" ".join(words), flag)] = action.choices
    assert seen[("bench transfer", "--dtype")] == ("bf16", "fp16", "fp32")
    del seen[("bench transfer", "--dtype")]
    dtypes = tuple(d.value for d in DType)
    kinds = {k.value for k in StorageBackendKind} | {L3_NONE}  # none: no L3
    for (command, flag), choices in seen.items():
        if flag == "--dtype":
            assert tuple(choices) == dtypes, command
        else:  # None: every kind, checked by the command's settings
            assert choices is None or set(choices) <= kinds, command
    assert seen[("serve", "--l3")] is None
    assert set(seen[("bench chaos", "--l3")]) == {"file", "mooncake", "none"}  # none: vllm
    assert {c for c, f in seen if f == "--dtype"} >= {
        "serve", "demo", "bench prefix", "bench instances", "bench pd", "bench matrix",
        "bench serve", "bench chaos"}


@pytest.mark.parametrize("argv", [
    ["serve", "--l3", "none", "--tp", "2", "--dtype", "fp32", "--model", "tiny"],
    ["serve", "--l3", "simulated", "--l3-root", "/tmp/x"],
    ["demo", "--l3", "nixl", "--dtype", "bf16", "--model", "gemma3-270m", "--tp", "1"],
    ["bench", "transfer", "--dtype", "fp16"],
    ["bench", "chaos", "--l3", "mooncake", "--model", "smollm2", "--tp", "3"],
    ["bench", "soak", "--l3", "nixl", "--model", "tiny", "--tp", "2"],
    ["bench", "matrix", "--out", "/tmp/m", "--model", "/some/dir", "--dtype", "fp32"],
    ["bench", "serve", "--model", "tiny", "--dtype", "bf16"],
])
def test_existing_invocations_still_parse(argv):
    from kvtier.cli.main import build_parser

    ns = build_parser().parse_args(argv)
    flags = argv[next(i for i, a in enumerate(argv) if a.startswith("--")):]
    for flag, value in zip(flags[::2], flags[1::2]):
        assert str(getattr(ns, flag.lstrip("-").replace("-", "_"))) == value


@pytest.mark.parametrize("argv", [
    ["demo", "--l3", "none"],  # the demo shows L3 hits
    ["bench", "chaos", "--l3", "nixl"],  # chaos restarts the file or Mooncake store
    ["bench", "transfer", "--dtype", "auto"],
    ["demo", "--dtype", "fp16"],
])
def test_narrower_choices_are_refused_by_the_parser(argv, capsys):
    from kvtier.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
    assert "invalid choice" in capsys.readouterr().err
