"""TP=3 on Ray with a shared L3: instance A writes documents, instance B reads them while one
of its ranks sees something the others do not. Each case: B's answers equal the cold answers
(an in-process engine's, no L3), the injected fault fired (the faulty rank counted it),
nothing hangs (bounded by the module's timeout), no rank of any instance leaks a page or lock.

The rank-local faults (through `FaultyRank`):
- one rank's directory lookups fail (the page is a miss there, a hit elsewhere);
- the directory publishes the pages between one rank's lookup and the others' (deterministic:
  that rank's lookups are answered as before the publication);
- one rank is short of L2 room (its prefetch cannot start, the others' can).
"""
from __future__ import annotations

import random
import uuid
from typing import Any, Callable, NamedTuple

import pytest
import torch
from faulty_rank import FaultyRank

from kvtier.actors.instance import Instance
from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
from kvtier.actors.rank_actor import Rank, RankSettings
from kvtier.config import HiCacheConfig
from kvtier.cli.demo import namespace_spec
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weight_sources import TinyWeights

PAGE = 16
TP = 3
GREEDY = SamplingParams(max_new_tokens=4)
SOURCE = TinyWeights(seed=21)
CONFIG = HiCacheConfig(page_size=PAGE, prefetch_policy="wait_complete",
                       prefetch_threshold_tokens=PAGE, load_back_threshold_tokens=PAGE)
SETTINGS = RankSettings(SOURCE, CONFIG, device_pages=40, dtype=torch.float32, chunk_tokens=PAGE,
                        timeout_s=60.0)
PER_RANK_CPUS = 0.2

pytestmark = pytest.mark.timeout(600)


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


DOCS = [_tokens(100 + i, 5 * PAGE) for i in range(3)]


def _prompts(case: int) -> list[list[int]]:
    """Questions about the documents (A asks one, B another)."""
    return [doc + _tokens(1000 * case + i, 7) for i, doc in enumerate(DOCS)]


@pytest.fixture(scope="module")
def cluster(shared_ray, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp3")
    name = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    client = get_or_create_namespace_actor(name, str(tmp / "state"))
    instances = []
    try:
        spec = namespace_spec(SOURCE, CONFIG, "file", str(tmp / "l3"), "tiny",
                              f"t-{uuid.uuid4().hex[:6]}", dtype=torch.float32, page_size=PAGE,
                              tp_size=TP)
        info = client.register(spec)
        for _ in range(2):
            instances.append(Instance(SETTINGS._replace(l3=info, l3_actor=name), tp_size=TP,
                                      num_cpus_per_rank=PER_RANK_CPUS, ready_timeout_s=120.0,
                                      step_timeout_s=60.0, rank_class=FaultyRank))
        yield instances  # A, B
    finally:
        for inst in instances:
            inst.close()
        client.shutdown()


@pytest.fixture(scope="module")
def cold():
    """The cold reference: an in-process TP=1 engine without L3, as in the other actor tests
    (TP=2 and TP=3 answers equal TP=1 ones in fp32: test_rank_agreement, test_engine_parallel);
    three more rank processes cost more than the rest of the module's setup."""
    rank = Rank(0, 1, "", SETTINGS)
    yield rank
    rank.close()


def _cold(cold: Rank, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    out = []
    for prompt in prompts:
        cold.drop_cache()
        out.append(cold.engine.generate([prompt], GREEDY)[0].tokens)
    return out


def _no_leaks(*instances: Instance) -> None:
    for inst in instances:
        for audit in inst.rank_group.audit():
            assert audit.stray_device_pages == audit.stray_host_pages == 0, audit
            assert audit.locked_nodes == audit.protected_nodes == 0, audit
            assert audit.open_prefetches == 0, audit


class Fault(NamedTuple):
    """What a case does to instance B, and the count on the faulty rank that shows it fired."""

    rank: int
    arm: Callable[[Any], Any]  # a remote call on the FaultyRank's handle that arms it
    fired: str  # its name in FaultyRank.faults_fired
    undo: Callable[[Any], Any] | None = None


def _fired(b: Instance, fault: Fault) -> int:
    return b.on_rank(fault.rank, lambda a: a.faults_fired.remote()).get(fault.fired, 0)


def _case(cluster, cold, case: int, fault: Fault | None) -> list:
    a, b = cluster
    a_prompts, b_prompts = _prompts(case), _prompts(case + 50)
    expected = _cold(cold, b_prompts)
    a.generate(a_prompts, GREEDY)  # A writes the documents (and publishes them)
    a.quiesce()
    b.drop_cache()  # B's L1 and L2 are empty: the documents can only come from L3
    before = _fired(b, fault) if fault else 0
    if fault:
        b.on_rank(fault.rank, fault.arm)
    try:
        outs = [b.generate([p], GREEDY)[0] for p in b_prompts]
    finally:
        if fault and fault.undo is not None:
            b.on_rank(fault.rank, fault.undo)
    if fault:
        assert _fired(b, fault) - before >= 1, f"{fault.fired} on rank {fault.rank} never fired"
    assert [o.tokens for o in outs] == expected
    b.quiesce()
    _no_leaks(a, b)
    return outs


def test_one_ranks_lookups_fail(cluster, cold):
    _case(cluster, cold, 1, Fault(1, lambda a: a.fail_lookups.remote(len(DOCS)), "lookup",
                                  lambda a: a.release_hangs.remote()))


def test_pages_published_between_two_ranks_lookups(cluster, cold):
    _case(cluster, cold, 2, Fault(0, lambda a: a.publish_late.remote(len(DOCS)), "publish_late"))


def test_one_rank_short_of_host_room(cluster, cold):
    _case(cluster, cold, 3, Fault(2, lambda a: a.hold_host_pages.remote(0),
                                  "host_refused_tokens", lambda a: a.release_host_pages.remote()))


def test_without_faults_b_hits_what_a_wrote(cluster, cold):
    """The control: with no fault, B's requests come from L3."""
    outs = _case(cluster, cold, 4, None)
    assert all(o.cached.storage > 0 for o in outs)
