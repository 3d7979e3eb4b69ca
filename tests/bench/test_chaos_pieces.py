"""The pieces of `kvtier bench chaos` that need no cluster: the adversarial bodies, the fault
plan, the TP size, the judging of answers (near-ties followed, splices caught), the result's
targets and the command line."""
from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

import kvtier.cli.main as cli
from kvtier.bench import chaos
from kvtier.bench.answer_check import Verdict
from kvtier.bench.chaos_bodies import CHAT, COMPLETIONS, Limits, adversarial_body
from kvtier.bench.chaos_clients import ErrorRecord, Tally, error_cause
from kvtier.bench.cold_judge import Cold, check_answer
from kvtier.engine.sampling import TokenLogprob
from kvtier.errors import ConfigError
from kvtier.policies import StorageBackendKind
from kvtier.tiers.cache_types import CacheAudit

FILE, MOONCAKE = StorageBackendKind.FILE, StorageBackendKind.MOONCAKE
LIMITS = Limits("kvtier-tiny", 49152, 1952, 32, 1 << 20)


def test_adversarial_bodies_are_reproducible_and_mixed():
    bodies = [adversarial_body(random.Random(f"s:{i}"), LIMITS) for i in range(300)]
    again = [adversarial_body(random.Random(f"s:{i}"), LIMITS) for i in range(300)]
    assert bodies == again
    assert {b.path for b in bodies} == {CHAT, COMPLETIONS}
    parsed = []
    for body in bodies:
        try:
            parsed.append(json.loads(body.data))
        except (ValueError, RecursionError):  # "[" * 50000
            pass
    assert 0 < len(parsed) < len(bodies)  # garbage and JSON both
    assert any(len(b.data) > LIMITS.max_body_bytes for b in bodies)  # past the size limit
    fields = {k for p in parsed if isinstance(p, dict) for k in p}
    assert {"n", "seed", "top_logprobs", "stop", "max_tokens", "temperature"} <= fields


def test_fault_kinds_follow_the_graph_and_the_l3():
    F = chaos.Fault
    assert chaos.fault_kinds(FILE, False) == [F.KILL_RANK, F.KILL_NAMESPACE,
                                                F.NAMESPACE_STATE_LOST]
    assert F.RESTART_MOONCAKE_MASTER in chaos.fault_kinds(MOONCAKE, False)
    pd = chaos.fault_kinds(FILE, True)
    assert F.KILL_PREFILL_RANK in pd and F.KILL_DECODE_RANK in pd and F.KILL_RANK not in pd


def test_the_plan_brings_every_kind_once_before_any_twice():
    kinds = chaos.fault_kinds(MOONCAKE, True)
    injector = chaos.Injector.__new__(chaos.Injector)
    injector.kinds, injector.rng = kinds, random.Random(3)
    plan = injector.plan(2 * len(kinds) + 1)
    assert sorted(plan[:len(kinds)], key=str) == sorted(kinds, key=str)
    assert sorted(plan[len(kinds):2 * len(kinds)], key=str) == sorted(kinds, key=str)


def test_kinds_the_time_left_no_room_for_come_right_after_the_traffic():
    """A fault that takes long (a probe on a loaded machine) pushes the next past the
    deadline: the kinds not injected yet come after it, once each, nothing twice."""
    kinds = chaos.fault_kinds(MOONCAKE, False)
    injector = chaos.Injector.__new__(chaos.Injector)
    injector.kinds, injector.rng, injector.records = kinds, random.Random(3), []
    injector.vllm = injector.tally = None

    def slow(kind):
        time.sleep(0.3)  # every fault takes longer than the gap
        return True, "here"

    injector._apply = slow
    injector.every_s = 0.1
    start = time.monotonic()
    asyncio.run(injector.run(start, start + 0.35))
    assert sorted((r.kind for r in injector.records), key=str) == sorted(kinds, key=str)


def test_a_kind_never_armed_is_tried_again_after_the_traffic_until_it_is():
    """A kind whose tries all found what it needs missing (an instance too slow to name its
    engine) is tried again after the traffic until armed, within FAULT_GRACE_S; the kinds
    armed already are not."""
    kinds = chaos.fault_kinds(MOONCAKE, False)
    injector = chaos.Injector.__new__(chaos.Injector)
    injector.kinds, injector.rng, injector.records = kinds, random.Random(3), []
    injector.vllm = injector.tally = None
    stubborn, tries = kinds[0], []

    def apply(kind):
        tries.append(kind)
        return kind is not stubborn or tries.count(kind) >= 3, "here"

    injector._apply = apply
    injector.every_s = 0.05
    start = time.monotonic()
    asyncio.run(injector.run(start, start + 0.01))  # no room for any during the traffic
    armed = [r.kind for r in injector.records if r.armed]
    assert sorted(armed, key=str) == sorted(kinds, key=str)  # each armed once
    assert tries.count(stubborn) == 3
    assert all(tries.count(kind) == 1 for kind in kinds if kind is not stubborn)


def test_the_default_gap_spreads_one_fault_of_each_kind_over_the_run():
    three = len(chaos.fault_kinds(FILE, False))
    assert chaos.fault_gap_s(chaos.ChaosParams(minutes=2), three) == 30.0
    assert chaos.fault_gap_s(chaos.ChaosParams(minutes=0.75), three) == pytest.approx(11.25)
    assert chaos.fault_gap_s(chaos.ChaosParams(minutes=60), three) == chaos.MAX_FAULT_GAP_S
    assert chaos.fault_gap_s(chaos.ChaosParams(minutes=2, fault_every_s=7), three) == 7


def test_tp_is_two_where_the_model_splits_over_two():
    assert chaos.tp_size("tiny", None) == 2
    assert chaos.tp_size("smollm2", None) == 3  # three KV heads
    with pytest.raises(ConfigError, match="does not divide"):
        chaos.tp_size("smollm2", 2)


# ---- judging ---------------------------------------------------------------------------------
TIE = 1e-5  # a near-tie's gap, inside answer_check's tolerance


def rule(prefix: tuple[int, ...]) -> tuple[int, int, float]:
    """A made-up greedy model: the next token, the runner-up, and the gap between them (a
    near-tie after every prefix whose length is a multiple of 5)."""
    first = (sum(prefix) * 7 + len(prefix)) % 50 + 1
    second = first % 50 + 1
    return first, second, TIE if len(prefix) % 5 == 0 else 1.0


def cold(prompt: tuple[int, ...], max_tokens: int, stops: tuple[int, ...]) -> Cold:
    tokens, logprobs, seq = [], [], list(prompt)
    for _ in range(max_tokens):
        first, second, gap = rule(tuple(seq))
        tokens.append(first)
        logprobs.append(TokenLogprob(first, -1.0, ((first, -1.0), (second, -1.0 - gap))))
        seq.append(first)
        if first in stops:
            break
    return Cold(tuple(tokens), tuple(logprobs))


def greedy_after(prompt: tuple[int, ...], head: list[int], n: int) -> list[int]:
    """`head`, then the rule's greedy tokens up to `n` in all."""
    out = list(head)
    while len(out) < n:
        out.append(rule(prompt + tuple(out))[0])
    return out


PROMPT = (3, 1, 4)  # a near-tie at answer token 2 (prefix length 5)


def test_the_cold_answer_is_the_same():
    got = cold(PROMPT, 12, ()).tokens
    assert check_answer(cold, PROMPT, got, 12, ()) == (Verdict.SAME, None)


def test_a_near_tie_followed_by_its_own_greedy_continuation_is_a_near_tie():
    want = cold(PROMPT, 12, ()).tokens
    took_second = greedy_after(PROMPT, [*want[:2], rule(PROMPT + want[:2])[1]], 12)
    assert check_answer(cold, PROMPT, took_second, 12, ()) == (Verdict.NEAR_TIE, 2)


def test_a_stream_spliced_after_a_near_tie_is_wrong():
    """A first run's tokens, then another run's (which took the near-tie the other way)."""
    want = list(cold(PROMPT, 12, ()).tokens)
    other = greedy_after(PROMPT, [*want[:2], rule(PROMPT + tuple(want[:2]))[1]], 12)
    spliced = want[:2] + other[2:4] + want[4:]
    verdict, at = check_answer(cold, PROMPT, spliced, 12, ())
    assert verdict is Verdict.WRONG and at >= 3


def test_a_different_token_where_there_is_no_tie_is_wrong():
    want = list(cold(PROMPT, 12, ()).tokens)
    bad = want[:3] + [rule(PROMPT + tuple(want[:3]))[1]] + want[4:]
    assert check_answer(cold, PROMPT, bad, 12, ()) == (Verdict.WRONG, 3)


def test_an_answer_cut_short_is_wrong_even_after_a_near_tie():
    want = list(cold(PROMPT, 12, ()).tokens)
    assert check_answer(cold, PROMPT, want[:7], 12, ()) == (Verdict.WRONG, 7)
    took_second = [*want[:2], rule(PROMPT + tuple(want[:2]))[1]]  # and then nothing
    assert check_answer(cold, PROMPT, took_second, 12, ())[0] is Verdict.WRONG


def test_a_near_tie_that_takes_a_stop_token_ends_the_answer_there():
    want = cold(PROMPT, 12, ()).tokens
    stop = rule(PROMPT + want[:2])[1]
    assert check_answer(cold, PROMPT, [*want[:2], stop], 12, (stop,)) == (Verdict.NEAR_TIE, 2)


# ---- the result ------------------------------------------------------------------------------
def test_the_result_names_each_target_missed():
    from kvtier.actors.chaos_faults import RankAudit

    settings = chaos.ServeSettings(model="tiny", instances=2, tp_size=2, storage_backend=None)
    audit = RankAudit.of({"instance-0": [CacheAudit(stray_device_pages=0, stray_host_pages=1,
                                                    orphaned_host_pages=0, locked_nodes=0,
                                                    protected_nodes=2, open_prefetches=1)]})
    tally = Tally(sent=3, answered=2)
    tally.error(True, "http_503", '{"error": {"message": "instance gone"}}', 1.0, 2.0)
    served = chaos.Served(tally, [], audit, "",
                          {"instance-1": {"at_s": 1.0, "why": "broken"}}, {}, {}, True, 1.0)
    out = chaos.result_json(chaos.ChaosParams(), settings, served,
                            chaos.Judgement(2, 1, 0, 1, []))
    assert (out["leaked_pages"], out["leaked_locks"], out["instances_lost"]) == (1, 2, 1)
    assert out["open_tickets"] == 1  # the audit's open_prefetches (a key no audit had: read 0)
    assert out["missed"] == ["wrong", "server_errors", "instances_lost", "leaked_pages",
                             "leaked_locks"]
    assert out["unaccounted"] == 0
    assert out["error_samples_before_faults"][0]["cause"] == "instance gone"
    json.dumps(out)


def test_errors_are_told_by_the_fault_before_them():
    F, R = chaos.Fault, chaos.FaultRecord
    faults = [R(F.KILL_RANK, 10.0, True, "instance-0 rank 1"),
              R(F.KILL_NAMESPACE, 20.0, True, "namespace actor")]
    errors = [ErrorRecord(0.0, t, "http_503", True, "") for t in (1.0, 10.0, 12.5, 19.9, 25.0)]
    windows = chaos.errors_between(faults, errors)
    assert [[e.failed_s for e in w] for w in windows] == [[1.0], [10.0, 12.5, 19.9], [25.0]]
    assert chaos.errors_between([], errors[:1]) == [errors[:1]]


def test_an_error_keeps_its_cause():
    body = json.dumps({"error": {"message": "generation failed: \x1b[36mray::X\x1b[39m "
                                            + "trace " * 200 + "CacheUsageError: not registered"}})
    cause = error_cause(body)
    assert cause.endswith("CacheUsageError: not registered") and "\x1b" not in cause
    assert len(cause) <= 404


def test_the_command_line():
    ns = cli.build_parser().parse_args(["bench", "chaos", "--minutes", "2", "--l3", "mooncake",
                                        "--pd", "--json"])
    params = chaos.params_of(ns)
    assert (params.minutes, params.l3, params.pd, params.dtype) == (2.0, MOONCAKE, True,
                                                                    chaos.DType.FP32)
    for bad in (["--minutes", "0"], ["--minutes", "500"], ["--clients", "0"],
                ["--fault-every", "0.1"]):
        ns = cli.build_parser().parse_args(["bench", "chaos", *bad])
        with pytest.raises(ConfigError):
            chaos.params_of(ns)
