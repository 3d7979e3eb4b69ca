"""TP=2 rank actors on the tiny model (6 KV heads): lockstep steps, one agreement per step,
rank-local allocation failures, diverged caches and an L2->L1 load that fails on one rank
give the same tokens as TP=1, without a rank restart. TP=3 rank
actors over an L3 namespace: a waiting queue far longer than the agreement's slots, its head
stalled on one rank's hung L3 reads, is served in turn."""
from __future__ import annotations

import random
import uuid

import pytest
import torch

from faulty_rank import FaultyRank
from kvtier.actors.instance import Instance
from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
from kvtier.actors.rank_actor import Rank, RankSettings
from kvtier.bench.answer_check import Verdict, judge
from kvtier.config import HiCacheConfig
from kvtier.cli.demo import namespace_spec
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weight_sources import TinyWeights

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
        rank = Rank(0, 1, "", SETTINGS)
        try:
            out[name] = [o.tokens for o in rank.engine.generate(prompts, GREEDY)]
        finally:
            rank.close()
    return out


@pytest.fixture(scope="module")
def instance(instance_factory):
    with instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as inst:
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
    return instance.on_rank(1, lambda a: a.faults_fired.remote()).get("allocation_refused", 0)


def test_rank_local_allocation_failure_is_rolled_back_everywhere(instance, reference) -> None:
    before, refused = instance.stats(), _refused(instance)
    instance.on_rank(1, lambda a: a.refuse_allocations.remote(1))
    (out,) = instance.generate(PROMPTS["c"], GREEDY)
    after = instance.stats()
    assert _refused(instance) == refused + 1
    assert out.tokens == reference["c"][0]
    # Rank 0 reserved, rank 1 could not: rank 0 undid its reservation; the next step admitted.
    assert after[0].rolled_back - before[0].rolled_back == 1
    assert after[1].rolled_back == before[1].rolled_back
    assert len({s.steps for s in after}) == 1  # lockstep: no rank ran ahead or hung
    free = [instance.on_rank(r, lambda a: a.drop_cache.remote()) for r in range(2)]
    assert free == [SETTINGS.device_pages] * 2, "every page is back once the caches are dropped"


def test_diverged_caches_use_the_min_hit(instance, reference) -> None:
    (doc,) = instance.generate(PROMPTS["doc"], GREEDY)
    (hit,) = instance.generate(PROMPTS["hit"], GREEDY)
    assert (doc.tokens, hit.tokens) == (reference["doc"][0], reference["hit"][0])
    assert hit.cached.total == 32  # both ranks hold the document's first two pages
    instance.on_rank(1, lambda a: a.drop_cache.remote())  # rank 1 forgets them; rank 0 not
    before = instance.stats()
    (out,) = instance.generate(PROMPTS["diverged"], GREEDY)
    after = instance.stats()
    assert after[0].device_hit_tokens - before[0].device_hit_tokens == 32  # rank 0 hit...
    assert after[1].device_hit_tokens == before[1].device_hit_tokens       # ...rank 1 missed
    assert out.cached.total == 0 and out.lengths.extend_len == len(PROMPTS["diverged"][0])
    assert out.tokens == reference["diverged"][0]
    free = [instance.on_rank(r, lambda a: a.drop_cache.remote()) for r in range(2)]
    assert free == [SETTINGS.device_pages] * 2


def test_rank_local_decode_page_shortage_preempts_on_every_rank(instance, reference) -> None:
    ids = [instance.add_request(p, GREEDY) for p in PROMPTS["decode"]]
    before = instance.stats()
    instance.step()  # both admitted and prefilled
    instance.step()  # first decode: the 31-token prompt's KV still fits its two pages
    refused = _refused(instance)
    # the next decode needs a third page
    instance.on_rank(1, lambda a: a.refuse_allocations.remote(1))
    done = {}
    for _ in range(50):
        done.update({o.request_id: o for o in instance.step()})
        if len(done) == len(ids):
            break
    assert [done[i].tokens for i in ids] == reference["decode"]
    assert _refused(instance) == refused + 1  # rank 1 was short of the page
    after = instance.stats()
    assert after[0].steps - before[0].steps == after[1].steps - before[1].steps
    free = [instance.on_rank(r, lambda a: a.drop_cache.remote()) for r in range(2)]
    assert free == [SETTINGS.device_pages] * 2


@pytest.mark.timeout(180)
def test_a_load_failed_on_one_rank_is_recomputed_on_every_rank_without_a_restart(
        instance, reference) -> None:
    """Rank 1's load back of the prompt fails inside the forward: rank 1 finishes the forward
    (its peer is inside its all-reduces), every rank sees the prompt's rows poisoned and
    recomputes it in step. The old way, rank 1 left the forward, rank 0 waited for the
    collective to time out, and the instance rebuilt both ranks."""
    instance.drop_cache()
    (first,) = instance.generate(PROMPTS["doc"], GREEDY)
    assert first.tokens == reference["doc"][0]
    instance.evict_device()  # the prompt's pages are in L2 only, on both ranks
    restarts, before = instance.restarts, instance.stats()
    instance.on_rank(1, lambda a: a.fail_next_load.remote())
    (again,) = instance.generate(PROMPTS["doc"], GREEDY)
    assert again.tokens == reference["doc"][0]
    assert instance.restarts == restarts, "a rank was rebuilt"
    after = instance.stats()
    assert after[0].steps - before[0].steps == after[1].steps - before[1].steps
    failed = [s.counters["failed_load_tokens"] for s in instance.cache_snapshot()]
    assert failed[0] == 0 and failed[1] > 0  # it failed on rank 1 only
    for audit in instance.rank_group.audit():
        assert audit.stray_device_pages == audit.stray_host_pages == 0, audit
        assert audit.locked_nodes == audit.protected_nodes == 0, audit
    (third,) = instance.generate(PROMPTS["doc"], GREEDY)  # the L2 copies are intact
    assert third.tokens == reference["doc"][0] and third.cached.total > 0


def test_rank_processes_and_their_collective_listen_on_loopback_only(instance) -> None:
    """The TP group's gloo rendezvous store and pairs, and every Ray process, on 127.0.0.1."""
    import os

    from kvtier.netcheck import descendants, listening

    instance.generate([tokens(77, 40)], GREEDY)  # the collective has run
    found = listening(descendants(os.getpid()))
    assert found
    assert {l.host for l in found} <= {"127.0.0.1", "::1"}, found


# ---- TP=3 over L3: a waiting queue longer than the agreement's slots ----------------------
L3_CONFIG = HiCacheConfig(page_size=PAGE, prefetch_policy="wait_complete",  # L2 room for
                          hicache_ratio=4.0,  # every stalled request's prefetch
                          prefetch_threshold_tokens=PAGE, load_back_threshold_tokens=PAGE)
L3_SETTINGS = SETTINGS._replace(config=L3_CONFIG, device_pages=64)
SHORT = SamplingParams(max_new_tokens=3, logprobs=2)  # the top two: near-ties are told apart
DOC_L3 = tokens(2, 48)
STALLED = [DOC_L3 + tokens(100 + i, 3) for i in range(40)]
BEHIND = [tokens(1000 + i, 8) for i in range(160)]


@pytest.fixture(scope="module")
def tp3_l3(shared_ray, tmp_path_factory):
    """A TP=3 instance whose ranks share an L3 namespace (file backend); 0.2 CPU per rank so
    it fits the shared cluster next to the TP=2 instance."""
    tmp = tmp_path_factory.mktemp("window")
    name = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    client = get_or_create_namespace_actor(name, str(tmp / "state"))
    try:
        info = client.register(namespace_spec(
            L3_SETTINGS.source, L3_CONFIG, "file", str(tmp / "l3"), "tiny",
            f"t-{uuid.uuid4().hex[:6]}", dtype=torch.float32, page_size=PAGE, tp_size=3))
        with Instance(L3_SETTINGS._replace(l3=info, l3_actor=name), tp_size=3,
                      num_cpus_per_rank=0.2, ready_timeout_s=120.0, step_timeout_s=60.0,
                      rank_class=FaultyRank) as inst:
            yield inst
    finally:
        client.shutdown()


def test_tp3_serves_every_request_of_a_long_queue_whose_head_is_stalled(tp3_l3):
    """200 waiting requests: the first 40 wait for L3 reads that hang on rank 1, the 160
    behind them (far more than the agreement's 32 slots) are admitted and answered meanwhile;
    once the hang ends the 40 are answered too. Every answer is the cold one (or a near-tie),
    no rank restarted, nothing leaks."""
    cold = Rank(0, 1, "", SETTINGS)
    try:
        want = cold.engine.generate(STALLED + BEHIND, SHORT)
    finally:
        cold.close()
    inst = tp3_l3
    inst.generate([DOC_L3 + [5]], GREEDY)  # the document's pages go to L3...
    inst.quiesce()
    inst.drop_cache()  # ...and then are only there
    assert inst.on_rank(1, lambda a: a.inject.remote("get", "hang", -1))
    try:
        stalled = [inst.add_request(p, SHORT) for p in STALLED]
        behind = [inst.add_request(p, SHORT) for p in BEHIND]
        done = {}
        for _ in range(400):
            done.update((o.request_id, o) for o in inst.step())
            if set(behind) <= set(done):
                break
        assert set(behind) <= set(done), f"{len(set(behind) - set(done))} requests starved"
        assert not set(stalled) <= set(done), "the hang held none of them back"
    finally:
        # the hung reads fail: those are recomputed
        inst.on_rank(1, lambda a: a.release_hangs.remote())
    rest = [i for i in stalled if i not in done]
    done.update(zip(rest, inst.wait(rest)))
    verdicts = [judge(done[i].tokens, w.tokens, w.logprobs)
                for i, w in zip(stalled + behind, want)]
    assert Verdict.WRONG not in verdicts
    assert inst.restarts == 0
    inst.quiesce()
    for audit in inst.rank_group.audit():
        assert audit.stray_device_pages == audit.stray_host_pages == 0, audit
        assert audit.locked_nodes == audit.protected_nodes == 0, audit
        assert audit.open_prefetches == 0, audit
