"""A short soak in `make test`: mixed traffic, random aborts, an L3 fault every half second;
every request answered or aborted, no wrong answer, no leaked page or lock."""
from __future__ import annotations

import json

import pytest

from kvtier import cli
from kvtier.bench.soak import SoakParams, run


def test_a_short_soak_answers_everything_correctly_and_leaks_nothing():
    result = run(SoakParams(seconds=8.0, fault_every_s=0.5, seed=3))
    assert result.sent > 0 and result.faults_injected > 0
    assert result.answered + result.aborted == result.sent
    assert result.wrong == 0
    assert result.leaked_pages == 0 and result.leaked_locks == 0
    assert set(json.loads(json.dumps(result.to_json()))) >= {
        "sent", "answered", "wrong", "leaked_pages", "leaked_locks", "faults_injected",
        "rss_growth_mb"}


def test_soak_cli_parses():
    ns = cli.build_parser().parse_args(["bench", "soak", "--minutes", "0.5", "--json"])
    assert (ns.minutes, ns.json) == (0.5, True)


def test_a_short_soak_on_the_actor_system_at_tp3_with_two_instances(capsys):
    """`kvtier bench soak --tp 3 --instances 2 --model tiny`: two TP=3 instances share a file
    L3 under faults (L3 errors, hangs, torn and partial reads, corrupt objects, one rank's
    lookups failing, a rank killed, the namespace actor killed); every answer is the cold one,
    nothing hangs, nothing leaks on any rank."""
    rc = cli.main(["bench", "soak", "--tp", "3", "--instances", "2", "--model", "tiny",
                   "--minutes", "0.25", "--fault-every", "1.0", "--seed", "5", "--json"])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    assert lines, f"the soak printed no result (rc {rc}); its stderr:\n{captured.err[-4000:]}"
    result = json.loads(lines[-1])
    assert rc == 0, result
    assert result["sent"] > 0 and result["faults_injected"] >= 5
    assert result["answered"] + result["aborted"] == result["sent"]
    assert result["wrong"] == 0 and result["hangs"] == 0
    assert result["leaked_pages"] == 0 and result["leaked_locks"] == 0
    assert {"divergences", "rank_restarts", "faults_hit"} <= set(result)


def test_the_actor_soak_takes_a_model_directory(tmp_path):
    """--model DIR: the ranks load the directory and key pages as a rank keys them."""
    pytest.importorskip("transformers")
    from tiny_llama import make_checkpoint

    from kvtier.actors.rank_actor import namespace_model
    from kvtier.bench.actor_soak import _model
    from kvtier.engine.hf_dir import HFModelDir

    model_dir = make_checkpoint(tmp_path / "tiny-llama")
    ns = cli.build_parser().parse_args(["bench", "soak", "--tp", "2", "--model", str(model_dir)])
    model = _model(ns.model, seed=0)
    assert model.source == HFModelDir(str(model_dir))
    assert model.name == namespace_model(model.source) == model.source.identity()
