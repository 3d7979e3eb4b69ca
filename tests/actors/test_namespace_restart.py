"""The L3 namespace actor killed while two instances serve: requests in flight finish with
the right answers (L3 lookups and reports fail fast and count as misses meanwhile); Ray
restarts the actor, it rebuilds its directory from the file backend, and the instances hit
L3 again, including pages written while it was down."""
from __future__ import annotations

import random
import uuid

import pytest
import torch
from eventually import eventually

from kvtier.actors.instance import Instance
from kvtier.actors.l3.namespace_actor import _BACKOFF_MAX_S, get_or_create_namespace_actor
from kvtier.actors.l3.namespace_service import STATE_FILE
from kvtier.actors.rank_actor import Rank, RankSettings
from kvtier.config import HiCacheConfig
from kvtier.cli.demo import namespace_spec
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weight_sources import TinyWeights

PAGE = 16
CONFIG = HiCacheConfig(page_size=PAGE, prefetch_policy="wait_complete",
                       prefetch_threshold_tokens=PAGE)
SETTINGS = RankSettings(TinyWeights(seed=21), CONFIG, device_pages=48, dtype=torch.float32,
                        chunk_tokens=PAGE, timeout_s=30.0)
GREEDY = SamplingParams(max_new_tokens=5)

pytestmark = pytest.mark.timeout(240)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


PROMPTS = [tokens(s, 4 * PAGE + 3) for s in range(4)]  # four pages and a tail each
BACKOFF_BOUND_S = _BACKOFF_MAX_S + 30  # hang guard: a client's back-off, and some


def _came_back(client, before: str) -> None:
    """The killed actor's new incarnation answers (the kill is asynchronous)."""
    eventually(lambda: client.wait_ready(timeout_s=60) != before, 60,
               "the namespace actor came back", interval_s=0.1)


@pytest.fixture(scope="module")
def reference() -> list[tuple[int, ...]]:
    rank = Rank(0, 1, "", SETTINGS)
    try:
        return [o.tokens for o in rank.engine.generate(PROMPTS, GREEDY)]
    finally:
        rank.close()


def test_instances_keep_serving_through_a_namespace_actor_restart(shared_ray, tmp_path,
                                                                  reference):
    name = f"kvtier-l3-restart-{uuid.uuid4().hex[:6]}"
    client = get_or_create_namespace_actor(name, str(tmp_path / "state"))
    instances: list[Instance] = []
    try:
        info = client.register(namespace_spec(SETTINGS.source, CONFIG, "file",
                                              str(tmp_path / "l3"), "tiny", "restart",
                                              dtype=SETTINGS.dtype, page_size=PAGE))
        settings = SETTINGS._replace(l3=info, l3_actor=name)
        a, b = (Instance(settings, tp_size=1, ready_timeout_s=90, step_timeout_s=30)
                for _ in range(2))
        instances += [a, b]
        assert a.generate([PROMPTS[0]], GREEDY)[0].tokens == reference[0]
        a.quiesce()

        # Under load: both instances have requests in flight when the actor dies.
        before = client.ping()
        ids_a = [a.add_request(PROMPTS[1], GREEDY)]
        ids_b = [b.add_request(PROMPTS[0], GREEDY)]
        a.step()
        b.step()
        client.kill()
        ids_a.append(a.add_request(PROMPTS[2], GREEDY))
        outs_a, outs_b = a.wait(ids_a), b.wait(ids_b)
        assert [o.tokens for o in outs_a] == [reference[1], reference[2]]
        assert outs_b[0].tokens == reference[0]
        a.quiesce()  # A's backups of prompts 1 and 2 land; their reports may fail

        _came_back(client, before)

        def published() -> bool:
            a.quiesce()  # once its clients' back-off ends, A reports what the dead actor missed
            return client.stats(info.namespace).published_pages >= 3 * 4
        eventually(published, BACKOFF_BOUND_S, "A's pages were published again (rebuilt from "
                   "the files, or reported)", interval_s=0.2)

        # B hits in L3 what A wrote before and while the actor was down (once its own
        # clients' back-off has ended: until then its lookups are misses).
        def b_hits(i: int) -> bool:
            b.drop_cache()  # from L3, not from the last try's L1
            out = b.generate([PROMPTS[i]], GREEDY)[0]
            assert out.tokens == reference[i]  # hit or miss, the answer is right
            return out.cached.storage == 4 * PAGE
        eventually(lambda: b_hits(1), BACKOFF_BOUND_S, "B hit prompt 1 in L3", interval_s=0.2)
        assert b_hits(2), "B hit prompt 2 in L3"
        # and A keeps reporting to the new incarnation: prompt 3 is published once stored
        # (its report may wait out a back-off of A's client, as B's lookups may: a bound,
        # not a moment; under a loaded machine both happened).
        assert a.generate([PROMPTS[3]], GREEDY)[0].tokens == reference[3]
        a.quiesce()
        eventually(lambda: b_hits(3), BACKOFF_BOUND_S, "B hit prompt 3 in L3", interval_s=0.2)
    finally:
        for inst in instances:
            inst.close()
        client.shutdown()


def storage_counter(inst: Instance, name: str) -> int:
    return inst.cache_snapshot()[0].storage[name]


def test_an_instance_keeps_answering_when_the_actor_comes_back_without_the_namespace(
        shared_ray, tmp_path, reference):
    """The actor restarts with a corrupt state file, so without the namespace: the instance
    keeps answering right (its L3 lookups are misses, counted), its rank registers the
    namespace again, the directory rebuilds from the files and L3 hits come back, for pages
    written before the restart and while the actor was away."""
    name = f"kvtier-l3-lost-{uuid.uuid4().hex[:6]}"
    state = tmp_path / "state"
    client = get_or_create_namespace_actor(name, str(state))
    inst = None
    try:
        info = client.register(namespace_spec(SETTINGS.source, CONFIG, "file",
                                              str(tmp_path / "l3"), "tiny", "lost",
                                              dtype=SETTINGS.dtype, page_size=PAGE))
        inst = Instance(SETTINGS._replace(l3=info, l3_actor=name), tp_size=1,
                        ready_timeout_s=90, step_timeout_s=30)
        assert inst.generate([PROMPTS[0]], GREEDY)[0].tokens == reference[0]
        inst.quiesce()
        misses = storage_counter(inst, "directory_miss_lookups")

        before = client.ping()
        (state / STATE_FILE).write_text("{ a corrupt state file")
        in_flight = inst.add_request(PROMPTS[1], GREEDY)
        inst.step()
        client.kill()
        late = inst.add_request(PROMPTS[2], GREEDY)
        outs = inst.wait([in_flight, late])
        assert [o.tokens for o in outs] == [reference[1], reference[2]]
        eventually(lambda: client.wait_ready(timeout_s=60) != before, 60,
                   "the namespace actor came back", interval_s=0.1)

        # Back, without the namespace, until a rank's next check registers it again; every
        # answer meanwhile is right, and the lookups that could not ask are counted misses.
        def registered_again() -> bool:
            if info.namespace in client.namespaces():
                return True
            inst.drop_cache()
            assert inst.generate([PROMPTS[0]], GREEDY)[0].tokens == reference[0]
            return False

        eventually(registered_again, 60, "a rank registered the namespace again")
        assert storage_counter(inst, "directory_miss_lookups") > misses
        inst.quiesce()  # what waited for the directory is reported now

        for i in range(3):  # written before the restart (0) and while the actor was away
            inst.drop_cache()
            out = inst.generate([PROMPTS[i]], GREEDY)[0]
            assert out.cached.storage == 4 * PAGE and out.tokens == reference[i], (i, out)
    finally:
        if inst is not None:
            inst.close()
        client.shutdown()


def test_ranks_replaced_after_the_mooncake_master_moved_attach_where_it_is_now(shared_ray,
                                                                               tmp_path,
                                                                               reference):
    """The namespace actor dies and its new incarnation starts a new Mooncake master on a new
    port (a new epoch); a rank killed afterwards is replaced with ranks that open the namespace
    as it is now. The soak found this: the replacements opened the old address, failed to
    start, and the instance gave up."""
    name = f"kvtier-l3-moved-{uuid.uuid4().hex[:6]}"
    client = get_or_create_namespace_actor(name, str(tmp_path / "state"))
    inst = None
    try:
        info = client.register(namespace_spec(SETTINGS.source, CONFIG, "mooncake", "", "tiny",
                                              "moved", dtype=SETTINGS.dtype, page_size=PAGE))
        inst = Instance(SETTINGS._replace(l3=info, l3_actor=name), tp_size=1,
                        ready_timeout_s=90, step_timeout_s=30, max_restarts=1)
        assert inst.generate([PROMPTS[0]], GREEDY)[0].tokens == reference[0]
        before = client.ping()
        client.kill()
        _came_back(client, before)
        moved = client.info(info.namespace)
        assert moved.epoch > info.epoch and moved.options != info.options
        inst.kill_rank(0)
        assert inst.generate([PROMPTS[1]], GREEDY)[0].tokens == reference[1]
        assert inst.restarts == 1
    finally:
        if inst is not None:
            inst.close()
        client.shutdown()
