"""Instances of different TP sizes on Ray share one L3 namespace: a TP=1 instance writes
documents that a TP=3 instance reads from L3, and back. The tiny model has 6 KV heads: the
TP=1 rank writes all six head objects of a page, each TP=3 rank two. Answers must equal the
cold answers (an in-process TP=1 engine without L3) and come from L3 hits."""
from __future__ import annotations

import uuid

import pytest
import torch
from eventually import eventually
from test_tp3_shared_l3 import CONFIG, GREEDY, PAGE, PER_RANK_CPUS, SETTINGS, SOURCE, _tokens

from kvtier.actors.instance import Instance
from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
from kvtier.actors.rank_actor import Rank
from kvtier.cli.demo import namespace_spec
from kvtier.engine.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def instances(shared_ray, tmp_path_factory):
    """A TP=1 and a TP=3 instance on one namespace (registered once, for every TP size)."""
    tmp = tmp_path_factory.mktemp("cross-tp")
    name = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    client = get_or_create_namespace_actor(name, str(tmp / "state"))
    made: dict[int, Instance] = {}
    try:
        spec = namespace_spec(SOURCE, CONFIG, "file", str(tmp / "l3"), "tiny",
                              f"t-{uuid.uuid4().hex[:6]}", dtype=torch.float32, page_size=PAGE)
        info = client.register(spec)
        for tp in (1, 3):
            made[tp] = Instance(SETTINGS._replace(l3=info, l3_actor=name), tp_size=tp,
                                num_cpus_per_rank=PER_RANK_CPUS, ready_timeout_s=120.0,
                                step_timeout_s=60.0)
        yield made, client, info.namespace
    finally:
        for inst in made.values():
            inst.close()
        client.shutdown()


@pytest.fixture(scope="module")
def cold():
    rank = Rank(0, 1, "", SETTINGS)
    yield rank
    rank.close()


@pytest.mark.parametrize("writer_tp, reader_tp", [(1, 3), (3, 1)])
def test_a_reader_of_another_tp_size_hits_what_a_writer_stored(instances, cold, writer_tp,
                                                               reader_tp):
    made, client, ns = instances
    writer, reader = made[writer_tp], made[reader_tp]
    prompts = [_tokens(10 * writer_tp + i, 5 * PAGE + 3) for i in range(2)]
    expected = []
    for prompt in prompts:
        cold.drop_cache()
        expected.append(cold.engine.generate([prompt], GREEDY)[0].tokens)
    written = writer.generate(prompts, GREEDY)
    writer.quiesce()
    reader.drop_cache()  # the reader's L1 and L2 are empty: the pages can only come from L3
    outs = [reader.generate([p], GREEDY)[0] for p in prompts]
    assert [o.tokens for o in outs] == expected == [o.tokens for o in written]
    assert all(o.cached.storage >= 4 * PAGE for o in outs), [o.cached for o in outs]
    assert client.stats(ns).published_pages >= 2 * 5


def test_a_purge_empties_the_namespace_and_the_ranks_back_their_pages_up_again(instances,
                                                                              cold):
    """After a purge the ranks follow the namespace's new epoch: they forget what they
    believed was in L3 and write their L2 pages again, so readers hit them once more."""
    made, client, ns = instances
    writer, reader = made[3], made[1]
    prompt = _tokens(77, 5 * PAGE + 3)
    writer.generate([prompt], GREEDY)
    writer.quiesce()
    held = client.stats(ns).published_pages
    assert held >= 5 and client.purge(ns) >= held
    after = client.stats(ns)
    assert after.published_pages == 0 and after.purged_pages >= held

    def republished() -> bool:
        writer.generate([_tokens(5, 3)], SamplingParams(max_new_tokens=1))  # a few steps
        writer.quiesce()
        return client.stats(ns).published_pages >= held

    eventually(republished, 60, "the writer's ranks saw the purge's new epoch and stored "
               "the prefix again", interval_s=0.0)
    reader.drop_cache()
    out = reader.generate([prompt], GREEDY)[0]
    cold.drop_cache()
    assert out.tokens == cold.engine.generate([prompt], GREEDY)[0].tokens
    assert out.cached.storage >= 4 * PAGE
