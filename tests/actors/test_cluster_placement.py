"""A real two-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, all on 127.0.0.1),
one for the module: the head offering `kvtier_head` and `kvtier_node1`, the worker two units
of `kvtier_instance` and `kvtier_node2`.

Two nodes: the namespace actor on the head, instance A's rank actor on the head node and
instance B's on the worker node (their own custom resources), one `file` L3 namespace in
tmp_path that both nodes reach (one machine: one filesystem). B hits in L3 the pages A wrote
and answers with the same greedy tokens as A's cold run.

Placement on a cluster kvtier joins (`kvtier serve --address`), for real: a placement the
cluster cannot meet fails in seconds, before Serve starts, naming the resource and the nodes;
one it can meet puts the namespace actor on the head and the ranks on the worker, and
answers. (These run after the two-node tests: a joined deployment leaves Serve running.)"""
from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
import time
import uuid

import pytest
import requests
import torch

from kvtier.actors.ray_env import LOOPBACK  # sets Ray's env before Ray starts

import ray  # noqa: E402  (after ray_env: it pins Ray to loopback at import)
import ray._private.state as ray_state  # noqa: E402  (the GCS tables: no dashboard needed)

from kvtier.actors import serve_graph  # noqa: E402
from kvtier.actors.instance import Instance  # noqa: E402
from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor  # noqa: E402
from kvtier.actors.rank_actor import Rank, RankSettings  # noqa: E402
from kvtier.config import HiCacheConfig  # noqa: E402
from kvtier.cli.demo import namespace_spec  # noqa: E402
from kvtier.engine.sampling import SamplingParams  # noqa: E402
from kvtier.engine.weight_sources import TinyWeights  # noqa: E402
from kvtier.errors import PlacementError  # noqa: E402
from kvtier.netcheck import listening  # noqa: E402
from kvtier.frontend.settings import ServeSettings  # noqa: E402

PORT = 8137
SETTINGS = ServeSettings(model="tiny", instances=1, tp_size=2, page_size=16, chunk_tokens=64,
                         device_pages=32, max_new_tokens=4, dtype="fp32",
                         admin_key="test-admin-key-0123456789")
FAIL_FAST_S = 30.0  # the instance's placement-group wait would take 120 s

PAGE = 16
HEAD_RES, NODE1_RES, NODE2_RES = "kvtier_head", "kvtier_node1", "kvtier_node2"
CONFIG = HiCacheConfig(page_size=PAGE, prefetch_policy="wait_complete",
                       prefetch_threshold_tokens=PAGE)
RANK_SETTINGS = RankSettings(TinyWeights(seed=5), CONFIG, device_pages=32,
                             dtype=torch.float32, chunk_tokens=PAGE, timeout_s=30.0)
GREEDY = SamplingParams(max_new_tokens=6)
_rng = random.Random(7)
PROMPT = [_rng.randrange(1, 256) for _ in range(4 * PAGE + 6)]  # four full pages and a tail

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    with cluster_factory((1, {HEAD_RES: 1, NODE1_RES: 1}),
                         (2, {"kvtier_instance": 2, NODE2_RES: 1})) as c:
        c.worker = c.workers[0]
        c.node_ids = {NODE1_RES: c.head_node.node_id, NODE2_RES: c.worker.node_id}
        yield c


@pytest.fixture
def connected(cluster):
    """This process as a driver of the cluster, for one test."""
    ray.init(address=cluster.address, log_to_driver=False, _node_ip_address=LOOPBACK)
    try:
        cluster.wait_for_nodes(timeout=60)
        yield cluster
    finally:
        ray.shutdown()


def _node_of(actor) -> str:
    row = ray_state.actors(actor._actor_id.hex())
    return row["Address"]["NodeID"]


def test_two_nodes_share_l3_pages_across_instances(connected, tmp_path) -> None:
    cluster = connected
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
            RANK_SETTINGS.source, CONFIG, "file", str(tmp_path / "l3"), "tiny", "two-nodes",
            dtype=RANK_SETTINGS.dtype, page_size=PAGE))
        settings = RANK_SETTINGS._replace(l3=info)
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
    ref = Rank(0, 1, "", RANK_SETTINGS)
    try:
        assert ref.engine.generate([PROMPT], GREEDY)[0].tokens == cold.tokens
    finally:
        ref.close()


def test_a_tp_group_on_another_node_meets_at_a_port_chosen_on_that_node(connected,
                                                                        monkeypatch) -> None:
    """The rendezvous port of a rank set on the worker node is chosen there, never on the
    driver's node (a port free here may be taken there)."""
    import kvtier.actors.instance as instance_module

    def not_here() -> str:
        raise AssertionError("the driver chose the rendezvous port of ranks on another node")

    monkeypatch.setattr(instance_module, "loopback_init_method", not_here)
    b = Instance(RANK_SETTINGS, tp_size=2, resources={"kvtier_instance": 1},
                 ready_timeout_s=60, step_timeout_s=30)
    try:
        assert {_node_of(r) for r in b.ranks} == {connected.node_ids[NODE2_RES]}
        assert b.generate([PROMPT], GREEDY)[0].tokens
    finally:
        b.close()


def test_auto_master_host_is_the_actors_node_address_on_two_nodes(connected, tmp_path,
                                                                   monkeypatch) -> None:
    """With two alive nodes "auto" binds the node's address (here every node is 127.0.0.1,
    so the address is faked for the decision only); a registered Mooncake namespace's
    master then listens on the head's address and nowhere else."""
    cluster = connected
    from kvtier.actors.l3 import hosts as l3_hosts
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
            RANK_SETTINGS.source, CONFIG, "mooncake", "", "tiny", "two-nodes-mc",
            dtype=RANK_SETTINGS.dtype, page_size=PAGE))
        host = info.options["master_address"].rpartition(":")[0]
        assert host == LOOPBACK  # the head's Ray address in this cluster
        found = {l.host for l in listening(cluster.pids() - before)}
        assert found == {LOOPBACK}, found  # the master: RPC and metrics on that address only
    finally:
        client.shutdown()


def _start_fails(cluster, settings: ServeSettings) -> str:
    t0 = time.monotonic()
    try:
        with pytest.raises(PlacementError) as err:
            serve_graph.start(settings, port=PORT, address=cluster.address)
    finally:
        serve_graph.stop(joined=True)
    assert time.monotonic() - t0 < FAIL_FAST_S
    return str(err.value)


def test_too_few_instance_units_fail_fast_naming_the_nodes(cluster) -> None:
    msg = _start_fails(cluster, dataclasses.replace(SETTINGS, instances=2))
    worker = cluster.worker.node_id[:8]
    assert "4 units of 'kvtier_instance'" in msg and "offer 2" in msg, msg
    assert f"127.0.0.1 node {worker} has 2" in msg, msg


def test_a_missing_head_resource_fails_fast(cluster, tmp_path) -> None:
    msg = _start_fails(cluster, dataclasses.replace(SETTINGS, head_resource="kvtier_l3_host",
                                                    storage_backend="file", l3_root=str(tmp_path)))
    assert "no alive node offers the resource 'kvtier_l3_host'" in msg, msg


def test_a_serve_config_on_this_cluster_is_checked_too(cluster) -> None:
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        args = {**SETTINGS.to_mapping(), "instances": 2}  # "placement: auto" on two nodes
        with pytest.raises(PlacementError, match="kvtier_instance"):
            serve_graph.app_builder(args)
    finally:
        ray.shutdown()


def _nodes_of(class_name: str) -> set[str]:
    return {a["Address"]["NodeID"] for a in ray_state.actors().values()
            if a["ActorClassName"] == class_name and a["State"] == "ALIVE"}


def test_ranks_on_the_instance_node_namespace_actor_on_the_head(cluster, tmp_path) -> None:
    settings = dataclasses.replace(SETTINGS, storage_backend="file", l3_root=str(tmp_path),
                                   l3_actor="kvtier-l3-placement")
    try:
        serve_graph.start(settings, port=PORT, address=cluster.address)
        assert _nodes_of("Rank") == {cluster.worker.node_id}
        assert _nodes_of("NamespaceService") == {cluster.head_node.node_id}
        r = requests.post(f"http://{LOOPBACK}:{PORT}/v1/completions", timeout=60,
                          json={"model": settings.served_model_name, "prompt": "hello there",
                                "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
    finally:
        serve_graph.stop(joined=True)


def test_an_unplaceable_rank_set_says_which_nodes_offer_what(cluster) -> None:
    from kvtier.actors.instance import Instance
    from kvtier.actors.serve_instance import rank_settings

    ray.init(address=cluster.address, log_to_driver=False)
    try:  # three ranks, two units on the only node that offers them: Ray waits; we don't
        with pytest.raises(PlacementError) as err:
            Instance(rank_settings(SETTINGS), tp_size=3, strategy="STRICT_PACK",
                     resources={"kvtier_instance": 1}, ready_timeout_s=2.0)
    finally:
        ray.shutdown()
    msg = str(err.value)
    assert "none of 3 bundles" in msg and "in 2 s" in msg, msg
    assert f"kvtier_instance: 127.0.0.1 node {cluster.worker.node_id[:8]} has 2" in msg, msg


def test_joining_a_routable_address_undoes_the_loopback_pin(monkeypatch) -> None:
    from ray._private import ray_constants

    from kvtier.actors.ray_join import is_loopback, unpin_from_loopback

    monkeypatch.setenv(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, "0")
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    unpin_from_loopback()
    assert ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR not in os.environ
    assert ray_constants.ENABLE_RAY_CLUSTER
    assert is_loopback("127.0.0.1:6379") and is_loopback("localhost:6379")
    assert is_loopback("[::1]:6379") and not is_loopback("10.0.0.1:6379")


JOIN_WITHOUT_TOKEN = """
import sys
from kvtier.actors.ray_join import join_cluster
from kvtier.errors import ClusterJoinError
try:
    join_cluster(sys.argv[1])
except ClusterJoinError as exc:
    print("ERROR:", exc)
"""


def test_a_missing_token_says_how_to_provide_it(cluster, tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.update(RAY_AUTH_MODE="token", HOME=str(tmp_path))  # auth on, no token anywhere
    out = subprocess.run([sys.executable, "-c", JOIN_WITHOUT_TOKEN, cluster.address], env=env,
                         capture_output=True, text=True, timeout=60).stdout
    assert "ERROR:" in out and "no authentication token was found" in out, out
    assert "RAY_AUTH_TOKEN_PATH" in out and "~/.ray/auth_token" in out, out
