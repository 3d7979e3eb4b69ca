"""What the serve graph needs of PDDriver, on Ray over NIXL: `step_report` streams each
request's tokens (the prefill's first token, then the decode side's, log-probabilities
joined) to the answer a mixed instance gives, and `abort` stops a request in either stage
leaking nothing on either side."""
from __future__ import annotations

import random

import pytest
import torch

from kvtier.actors.pd.driver import PDDriver, PDMode
from kvtier.actors.rank_actor import RankSettings
from kvtier.config import HiCacheConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weight_sources import TinyWeights

pytest.importorskip("nixl")

SETTINGS = RankSettings(TinyWeights(seed=3), HiCacheConfig(page_size=16), device_pages=48,
                        dtype=torch.float32, timeout_s=30.0)
SAMPLING = SamplingParams(max_new_tokens=6, logprobs=2)
PROMPT = [random.Random(5).randrange(1, 256) for _ in range(40)]


@pytest.fixture(scope="module")
def pd(instance_factory):
    with instance_factory(SETTINGS, tp_size=1) as mixed:
        (want,) = mixed.generate([PROMPT], SAMPLING)
    with instance_factory(SETTINGS, tp_size=1) as p, instance_factory(SETTINGS, tp_size=1) as d:
        yield PDDriver([p], [d], transport="nixl"), want


def no_leaks(driver: PDDriver) -> None:
    for inst in [*driver.prefill, *driver.decode]:
        for audit in inst.rank_group.audit():
            assert not any(audit), audit
        for c in inst.handoff_counters():
            assert c.reserved_pages == 0 and c.handed_requests == 0, c


def run(driver: PDDriver, rid: int, steps: int = 500):
    """Every progress of `rid` in order, and its output."""
    seen = []
    for _ in range(steps):
        step = driver.step_report()
        if rid in step.progress:
            seen.append(step.progress[rid])
        for out in step.finished:
            if out.request_id == rid:
                return seen, out
    raise AssertionError(f"request {rid} unfinished after {steps} steps")


def test_progress_streams_the_mixed_answer_with_its_logprobs(pd):
    driver, want = pd
    rid = driver.add(PROMPT, SAMPLING)
    seen, out = run(driver, rid)
    assert out.mode is PDMode.HANDOFF and out.tokens == want.tokens
    assert seen[0].start == 0 and seen[0].tokens == want.tokens[:1]  # the prefill
    # instance's first token, at once; then each token once, in order
    assert [p.start for p in seen] == [sum(len(q.tokens) for q in seen[:i])
                                       for i in range(len(seen))]
    assert sum((p.tokens for p in seen), ()) == out.tokens[:seen[-1].stop]
    for got in [*seen, out]:
        assert len(got.logprobs) == len(got.tokens)
        assert [lp.token for lp in got.logprobs] == list(got.tokens)
    assert [round(lp.logprob, 4) for lp in out.logprobs] == \
        [round(lp.logprob, 4) for lp in want.logprobs]
    assert out.transfer_pages == 3 and out.transfer_bytes > 0 and out.queue_s is not None
    no_leaks(driver)


@pytest.mark.parametrize("stage", ["prefill", "decode"])
def test_abort_in_either_stage_frees_both_sides(pd, stage):
    driver, _ = pd
    rid = driver.add(PROMPT, SamplingParams(max_new_tokens=200))
    if stage == "decode":  # until the decode instance has produced tokens of its own
        for _ in range(500):
            step = driver.step_report()
            if rid in step.progress and step.progress[rid].stop >= 3:
                break
        else:
            raise AssertionError("no decode progress")
    assert driver.abort(rid) and not driver.abort(rid)
    assert driver.num_pending == 0
    for _ in range(3):
        assert driver.step_report().finished == []  # nothing of it comes back
    no_leaks(driver)


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_rank_lost_mid_answer_never_splices_the_stream(pd, victim):
    """A decode rank killed after the decode side streamed tokens (its instance replaces its
    ranks and the request goes on after what it returned), or a prefill rank killed while
    the answer decodes (nothing of it is lost): every token comes once, in order, and the
    answer is whole."""
    driver, _ = pd
    sampling = SamplingParams(max_new_tokens=16, logprobs=2)
    with_kill = driver.add(PROMPT, sampling)
    streamed, out, killed = [], None, False
    for _ in range(500):
        step = driver.step_report()
        got = step.progress.get(with_kill)
        if got is not None:
            assert got.start == len(streamed)
            streamed += got.tokens
        out = next((o for o in step.finished if o.request_id == with_kill), out)
        if out is not None:
            break
        if not killed and len(streamed) >= 4:
            inst = driver.decode[0] if victim == "decode" else driver.prefill[0]
            inst.kill_rank(0)
            killed = True
    assert killed and out is not None
    assert tuple(streamed) == out.tokens[:len(streamed)] and len(out.tokens) == 16
    assert len(out.logprobs) == 16
    no_leaks(driver)
