"""TP=2 rank actors on the tiny model (6 KV heads): lockstep steps, one agreement per step,
rank-local allocation failures and diverged caches give the same tokens as TP=1."""
from __future__ import annotations

import random

import pytest
import torch

from faulty_rank import FaultyRankCache
from kvtier.actors.instance import Instance
from kvtier.actors.rank_actor import RankCache, RankSettings
from kvtier.config import HiCacheConfig
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.tp_worker import TinyWeights

PAGE = 16
SETTINGS = RankSettings(TinyWeights(seed=3), HiCacheConfig(page_size=PAGE), device_pages=32,
                        dtype=torch.float32, timeout_s=30.0)
GREEDY = SamplingParams(max_new_tokens=5)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


DOC = tokens(1, 48)  # three full pages
PROMPTS = {
    "a": [tokens(10, 40), tokens(11, 70), tokens(12, 17)],
    "c": [tokens(20, 33)],
    "doc": [DOC],
    "hit": [DOC[:32] + tokens(30, 20)],
    "diverged": [DOC[:32] + tokens(31, 20)],
    "decode": [tokens(40, 31), tokens(41, 20)],
}


@pytest.fixture(scope="module")
def reference() -> dict[str, list[tuple[int, ...]]]:
    """Greedy tokens of an in-process TP=1 engine, one fresh engine per prompt group."""
    out = {}
    for name, prompts in PROMPTS.items():
        rank = RankCache(0, 1, "", SETTINGS)
        try:
            out[name] = [o.tokens for o in rank.engine.generate(prompts, GREEDY)]
        finally:
            rank.close()
    return out


@pytest.fixture(scope="module")
def instance(instance_factory):
    with instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRankCache) as inst:
        yield inst


def test_tp2_matches_tp1_with_one_agreement_per_step(instance, reference) -> None:
    before = instance.stats()
    outs = instance.generate(PROMPTS["a"], GREEDY)
    after = instance.stats()
    assert [o.tokens for o in outs] == reference["a"]
    assert [s.num_kv_heads for s in after] == [3, 3]  # each rank caches its half of 6 heads
    for b, a in zip(before, after):
        steps = a.steps - b.steps
        assert steps > 0 and a.agreement_rounds - b.agreement_rounds == steps


def _refused(instance) -> int:
    return instance.rank_call(1, "faults_fired").get("allocation_refused", 0)


def test_rank_local_allocation_failure_is_rolled_back_everywhere(instance, reference) -> None:
    before, refused = instance.stats(), _refused(instance)
    instance.rank_call(1, "refuse_allocations", 1)
    (out,) = instance.generate(PROMPTS["c"], GREEDY)
    after = instance.stats()
    assert _refused(instance) == refused + 1
    assert out.tokens == reference["c"][0]
    # Rank 0 reserved, rank 1 could not: rank 0 undid its reservation; the next step admitted.
    assert after[0].rolled_back - before[0].rolled_back == 1
    assert after[1].rolled_back == before[1].rolled_back
    assert len({s.steps for s in after}) == 1  # lockstep: no rank ran ahead or hung
    free = [instance.rank_call(r, "drop_cache") for r in range(2)]
    assert free == [SETTINGS.device_pages] * 2, "every page is back once the caches are dropped"


def test_diverged_caches_use_the_min_hit(instance, reference) -> None:
    (doc,) = instance.generate(PROMPTS["doc"], GREEDY)
    (hit,) = instance.generate(PROMPTS["hit"], GREEDY)
    assert (doc.tokens, hit.tokens) == (reference["doc"][0], reference["hit"][0])
    assert hit.cached.total == 32  # both ranks hold the document's first two pages
    instance.rank_call(1, "drop_cache")  # rank 1 forgets them; rank 0 keeps them
    before = instance.stats()
    (out,) = instance.generate(PROMPTS["diverged"], GREEDY)
    after = instance.stats()
    assert after[0].device_hit_tokens - before[0].device_hit_tokens == 32  # rank 0 hit...
    assert after[1].device_hit_tokens == before[1].device_hit_tokens       # ...rank 1 missed
    assert out.cached.total == 0 and out.lengths.extend_len == len(PROMPTS["diverged"][0])
    assert out.tokens == reference["diverged"][0]
    free = [instance.rank_call(r, "drop_cache") for r in range(2)]
    assert free == [SETTINGS.device_pages] * 2


def test_rank_local_decode_page_shortage_preempts_on_every_rank(instance, reference) -> None:
    ids = [instance.add_request(p, GREEDY) for p in PROMPTS["decode"]]
    before = instance.stats()
    instance.step()  # both admitted and prefilled
    instance.step()  # first decode: the 31-token prompt's KV still fits its two pages
    refused = _refused(instance)
    instance.rank_call(1, "refuse_allocations", 1)  # the next decode needs a third page
    done = {}
    for _ in range(50):
        done.update({o.request_id: o for o in instance.step()})
        if len(done) == len(ids):
            break
    assert [done[i].tokens for i in ids] == reference["decode"]
    assert _refused(instance) == refused + 1  # rank 1 was short of the page
    after = instance.stats()
    assert after[0].steps - before[0].steps == after[1].steps - before[1].steps
    free = [instance.rank_call(r, "drop_cache") for r in range(2)]
    assert free == [SETTINGS.device_pages] * 2


def test_rank_processes_and_their_collective_listen_on_loopback_only(instance) -> None:
    """The TP group's gloo rendezvous store and pairs, and every Ray process, on 127.0.0.1."""
    import os

    from kvtier.netcheck import descendants, listening

    instance.generate([tokens(77, 40)], GREEDY)  # the collective has run
    found = listening(descendants(os.getpid()))
    assert found
    assert {l.host for l in found} <= {"127.0.0.1", "::1"}, found
