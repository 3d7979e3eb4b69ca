"""Rank faults at TP=2 on the tiny model: a rank killed between steps, a rank whose process
dies inside a step (its peer waiting in the agreement collective). The instance replaces its
ranks and recomputes every pending request: none lost, each equal to an undisturbed run."""
from __future__ import annotations

import random

import pytest
import torch

from faulty_rank import FaultyRank
from kvtier.actors.instance import Instance, InstanceError
from kvtier.actors.rank_actor import Rank, RankSettings
from kvtier.config import HiCacheConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weight_sources import TinyWeights

PAGE = 16
SETTINGS = RankSettings(TinyWeights(seed=11), HiCacheConfig(page_size=PAGE), device_pages=32,
                        dtype=torch.float32, chunk_tokens=PAGE, timeout_s=20.0)
GREEDY = SamplingParams(max_new_tokens=6)
SEEDED = SamplingParams(max_new_tokens=6, temperature=0.8, top_p=0.9, seed=1234)

pytestmark = pytest.mark.timeout(240)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


PROMPTS = [tokens(1, 50), tokens(2, 37), tokens(3, 70)]


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    """Undisturbed tokens: an in-process TP=1 engine (greedy for the first two, seeded for
    the third)."""
    rank = Rank(0, 1, "", SETTINGS)
    try:
        outs = rank.engine.generate(PROMPTS[:2], GREEDY) + \
            rank.engine.generate(PROMPTS[2:], SEEDED)
        return [o.tokens for o in outs]
    finally:
        rank.close()


@pytest.fixture(scope="module")
def instance(instance_factory):
    with instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as inst:
        yield inst


def _submit(inst: Instance) -> list[int]:
    return [inst.add_request(PROMPTS[0], GREEDY), inst.add_request(PROMPTS[1], GREEDY),
            inst.add_request(PROMPTS[2], SEEDED)]


def test_a_rank_killed_between_steps_is_replaced_and_nothing_is_lost(instance, reference):
    ids = _submit(instance)
    instance.step()  # the requests are in flight: prefilled in part, nothing finished
    instance.step()
    assert instance.num_pending == 3
    before = instance.restarts
    instance.kill_rank(1)
    outs = instance.wait(ids)
    assert instance.restarts == before + 1
    assert [o.request_id for o in outs] == ids  # the instance's ids survive the restart
    assert [o.tokens for o in outs] == reference
    assert instance.num_pending == 0
    stats = instance.stats()  # the new ranks answer and hold no pages for finished requests
    assert [s.rank for s in stats] == [0, 1]
    assert all(s.free_device_pages > 0 for s in stats)


def test_a_restart_mid_answer_goes_on_after_the_tokens_returned(instance, reference):
    """The answers' streamed tokens (step_report's progress) come once each, in order, and
    are the start of the final answer, across a restart in the middle of decoding: the
    requests go on after what they returned instead of starting again."""
    long = SamplingParams(max_new_tokens=24)
    seeded = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=1234,
                            logprobs=2)
    ids = [instance.add_request(PROMPTS[0], long), instance.add_request(PROMPTS[2], seeded)]
    streamed: dict[int, list] = {i: [] for i in ids}
    lps: dict[int, list] = {i: [] for i in ids}
    outs, before, killed = {}, instance.restarts, False
    for _ in range(500):
        if len(outs) == len(ids):
            break
        step = instance.step_report()
        for req_id, p in step.progress.items():
            assert p.start == len(streamed[req_id]), "each token once, in order"
            streamed[req_id] += p.tokens
            lps[req_id] += p.logprobs or ()
        outs.update((o.request_id, o) for o in step.finished)
        if not killed and all(len(streamed[i]) >= 5 for i in ids):
            instance.kill_rank(0)
            killed = True
    assert killed and instance.restarts == before + 1
    for req_id in ids:
        out = outs[req_id]
        assert tuple(streamed[req_id]) == out.tokens[:len(streamed[req_id])]
        assert len(out.tokens) == 24
    assert outs[ids[1]].logprobs[:len(lps[ids[1]])] == tuple(lps[ids[1]])
    assert len(outs[ids[1]].logprobs) == 24


def test_a_rank_dying_inside_a_step_is_replaced_and_nothing_is_lost(instance, reference):
    before = instance.restarts
    instance.on_rank(0, lambda a: a.crash_after.remote(3))
    ids = _submit(instance)
    outs = instance.wait(ids)
    assert instance.restarts == before + 1
    assert [o.tokens for o in outs] == reference
    # and the replaced instance keeps serving: a second round hits its own L1
    again = instance.generate([PROMPTS[0]], GREEDY)[0]
    assert again.tokens == reference[0] and again.cached.device > 0


def test_an_instance_without_restarts_left_says_so(instance):
    instance.max_restarts = 0
    try:
        instance.on_rank(1, lambda a: a.crash_after.remote(1))
        with pytest.raises(InstanceError, match="max_restarts=0"):
            instance.generate([PROMPTS[1]], GREEDY)
    finally:
        instance.max_restarts = 3


def test_a_rank_dying_during_a_load_back_is_replaced_and_nothing_is_lost(instance, reference):
    """The prompt's KV is in L2 only; rank 1 dies at the step whose admission loads it back
    (rank 0 loads, then waits for rank 1 in the agreement)."""
    instance.max_restarts = 3
    first = instance.generate([PROMPTS[0]], GREEDY)[0]
    assert first.tokens == reference[0]
    instance.evict_device()  # L1 -> L2: the next request is a load-back
    before = instance.restarts
    instance.on_rank(1, lambda a: a.crash_after.remote(0))
    again = instance.generate([PROMPTS[0]], GREEDY)[0]
    assert instance.restarts == before + 1
    assert again.tokens == reference[0]
