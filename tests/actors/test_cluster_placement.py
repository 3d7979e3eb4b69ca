"""Placement on a cluster kvtier joins (`kvtier serve --address`), for real: a two-node
`ray.cluster_utils.Cluster` on 127.0.0.1, the head offering `kvtier_head`, the worker two units
of `kvtier_instance`. A placement the cluster cannot meet fails in seconds, before Serve
starts, naming the resource and the nodes; one it can meet puts the namespace actor on the
head and the ranks on the worker, and answers."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest
import requests

from kvtier.actors.ray_env import LOOPBACK  # sets Ray's env before Ray starts

import ray  # noqa: E402
import ray._private.state as ray_state  # noqa: E402

from kvtier.actors import serve_graph  # noqa: E402
from kvtier.errors import PlacementError  # noqa: E402
from kvtier.serve.settings import ServeSettings  # noqa: E402

PORT = 8137
SETTINGS = ServeSettings(model="tiny", instances=1, tp_size=2, page_size=16, chunk_tokens=64,
                         device_pages=32, max_new_tokens=4, dtype="fp32",
                         admin_key="test-admin-key-0123456789")
FAIL_FAST_S = 30.0  # the instance's placement-group wait would take 120 s

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(cluster_factory):
    with cluster_factory((1, {"kvtier_head": 1}), (2, {"kvtier_instance": 2})) as c:
        c.worker = c.workers[0]
        yield c


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
                                                    l3="file", l3_root=str(tmp_path)))
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
    settings = dataclasses.replace(SETTINGS, l3="file", l3_root=str(tmp_path),
                                   l3_actor="kvtier-l3-placement")
    try:
        serve_graph.start(settings, port=PORT, address=cluster.address)
        assert _nodes_of("RankCache") == {cluster.worker.node_id}
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
