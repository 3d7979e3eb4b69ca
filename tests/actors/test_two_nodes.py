"""A real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, all on 127.0.0.1):
the namespace actor on the head (custom resource `kvtier_head`), instance A's rank actor on the
head node and instance B's on the worker node (their own custom resources), one `file` L3
namespace in tmp_path that both nodes reach (one machine: one filesystem). B hits in L3 the
pages A wrote and answers with the same greedy tokens as A's cold run."""
from __future__ import annotations

import random
import uuid

import pytest
import torch

from kvtier.actors.ray_env import LOOPBACK  # sets Ray's env before Ray starts

import ray  # noqa: E402  (after ray_env: it pins Ray to loopback at import)
import ray._private.state as ray_state  # noqa: E402  (the GCS tables: no dashboard needed)

from kvtier.actors.instance import Instance  # noqa: E402
from kvtier.actors.namespace_actor import get_or_create_namespace_actor  # noqa: E402
from kvtier.actors.rank_actor import RankCache, RankSettings  # noqa: E402
from kvtier.config import HiCacheConfig  # noqa: E402
from kvtier.demo import namespace_spec  # noqa: E402
from kvtier.engine.sampling import SamplingParams  # noqa: E402
from kvtier.engine.tp_worker import TinyWeights  # noqa: E402
from kvtier.netcheck import listening  # noqa: E402

PAGE = 16
HEAD_RES, NODE1_RES, NODE2_RES = "kvtier_head", "kvtier_node1", "kvtier_node2"
CONFIG = HiCacheConfig(page_size=PAGE, prefetch_policy="wait_complete",
                       prefetch_threshold_tokens=PAGE)
SETTINGS = RankSettings(TinyWeights(seed=5), CONFIG, device_pages=32, dtype=torch.float32,
                        chunk_tokens=PAGE, timeout_s=30.0)
GREEDY = SamplingParams(max_new_tokens=6)
_rng = random.Random(7)
PROMPT = [_rng.randrange(1, 256) for _ in range(4 * PAGE + 6)]  # four full pages and a tail

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    with cluster_factory((1, {HEAD_RES: 1, NODE1_RES: 1}), (1, {NODE2_RES: 1})) as c:
        ray.init(address=c.address, log_to_driver=False, _node_ip_address=LOOPBACK)
        c.wait_for_nodes(timeout=60)
        c.node_ids = {NODE1_RES: c.head_node.node_id, NODE2_RES: c.workers[0].node_id}
        yield c


def _node_of(actor) -> str:
    row = ray_state.actors(actor._actor_id.hex())
    return row["Address"]["NodeID"]


def test_two_nodes_share_l3_pages_across_instances(cluster, tmp_path) -> None:
    nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
    assert len(nodes) == 2
    assert {n["NodeManagerAddress"] for n in nodes.values()} == {LOOPBACK}
    assert nodes[cluster.node_ids[NODE2_RES]]["Resources"].get(NODE2_RES) == 1

    actor_name = f"kvtier-l3-2n-{uuid.uuid4().hex[:6]}"
    client = get_or_create_namespace_actor(actor_name,
                                           str(tmp_path / "state"), ready_timeout_s=60,
                                           resources={HEAD_RES: 1})
    instances = []
    try:
        assert _node_of(client.handle) == cluster.head_node.node_id
        info = client.register(namespace_spec(
            SETTINGS.source, CONFIG, "file", str(tmp_path / "l3"), "tiny", "two-nodes",
            dtype=SETTINGS.dtype, page_size=PAGE))
        settings = SETTINGS._replace(l3=info)
        if "l3_actor" in RankSettings._fields:  # ranks consult this actor's page directory
            settings = settings._replace(l3_actor=actor_name)
        a = Instance(settings, tp_size=1, resources={NODE1_RES: 1}, ready_timeout_s=60,
                     step_timeout_s=30)
        instances.append(a)
        b = Instance(settings, tp_size=1, resources={NODE2_RES: 1}, ready_timeout_s=60,
                     step_timeout_s=30)
        instances.append(b)
        assert _node_of(a.ranks[0]) == cluster.node_ids[NODE1_RES]
        assert _node_of(b.ranks[0]) == cluster.node_ids[NODE2_RES]

        cold = a.generate([PROMPT], GREEDY)[0]
        assert cold.cached.storage == 0 and cold.tokens
        a.quiesce()  # A's L2 -> L3 backups have landed and are published
        published = client.stats(info.namespace)
        hit = b.generate([PROMPT], GREEDY)[0]
        assert hit.cached.storage == 4 * PAGE, (hit.cached, published)
        assert hit.cached.device == hit.cached.host == 0
        assert hit.tokens == cold.tokens

        # Every Ray process of both nodes (GCS, raylets, workers, agents) listens on loopback.
        found = {l.host for l in listening(cluster.pids())}
        assert found and found <= {LOOPBACK, "::1"}, found
    finally:
        for inst in instances:
            inst.close()
        client.shutdown()

    # A single in-process engine without L3 gives the same tokens (no Ray involved).
    ref = RankCache(0, 1, "", SETTINGS)
    try:
        assert ref.engine.generate([PROMPT], GREEDY)[0].tokens == cold.tokens
    finally:
        ref.close()


def test_auto_master_host_is_the_actors_node_address_on_two_nodes(cluster, tmp_path,
                                                                   monkeypatch) -> None:
    """With two alive nodes "auto" binds the node's address (here every node is 127.0.0.1,
    so the address is faked for the decision only); a registered Mooncake namespace's
    master then listens on the head's address and nowhere else."""
    from kvtier.actors import l3_hosts
    from kvtier.storage_options import MooncakeOptions

    with monkeypatch.context() as m:
        m.setattr(l3_hosts, "node_address", lambda: "198.18.0.1")
        assert l3_hosts.cluster_master_host(MooncakeOptions()) == "198.18.0.1"
        assert l3_hosts.cluster_master_host(MooncakeOptions(master_host=LOOPBACK)) == LOOPBACK

    pytest.importorskip("mooncake.store")
    client = get_or_create_namespace_actor(f"kvtier-l3-mc-{uuid.uuid4().hex[:6]}",
                                           str(tmp_path / "state"), ready_timeout_s=60,
                                           resources={HEAD_RES: 1})
    try:
        before = cluster.pids()
        info = client.register(namespace_spec(
            SETTINGS.source, CONFIG, "mooncake", "", "tiny", "two-nodes-mc",
            dtype=SETTINGS.dtype, page_size=PAGE))
        host = info.options["master_address"].rpartition(":")[0]
        assert host == LOOPBACK  # the head's Ray address in this cluster
        found = {l.host for l in listening(cluster.pids() - before)}
        assert found == {LOOPBACK}, found  # the master: RPC and metrics on that address only
    finally:
        client.shutdown()
