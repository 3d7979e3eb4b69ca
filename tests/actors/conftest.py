"""Shared pieces of the actor tests."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Callable, Iterator

import pytest
import ray

from kvtier.actors.instance import Instance
from kvtier.actors.rank_actor import RankCache, RankSettings
from kvtier.actors.ray_env import LOOPBACK, pin_to_loopback, shutdown_local_ray, start_local_ray
from kvtier.netcheck import descendants

MiB = 1 << 20


@contextlib.contextmanager
def local_instance(settings: RankSettings, tp_size: int = 2,
                   rank_class: type[RankCache] = RankCache) -> Iterator[Instance]:
    """A TP instance on a fresh 2-CPU local Ray cluster, both gone afterwards."""
    start_local_ray(num_cpus=2)
    try:
        with Instance(settings, tp_size=tp_size, ready_timeout_s=90.0,
                      step_timeout_s=30.0, rank_class=rank_class) as inst:
            yield inst
    finally:
        shutdown_local_ray()


@pytest.fixture(scope="session")
def instance_factory() -> Callable:
    """`local_instance`, for module fixtures (test modules cannot import conftest reliably)."""
    return local_instance


@contextlib.contextmanager
def loopback_cluster(head: tuple[int, dict], *workers: tuple[int, dict]) -> Iterator[Any]:
    """A real multi-node Ray cluster on this machine (`ray.cluster_utils.Cluster`, every node
    on 127.0.0.1): `head` and each of `workers` as (num_cpus, custom resources); the worker
    nodes in `.workers`, the processes it started so far from `.pids()`. Afterwards this
    process is disconnected and every process the cluster started is gone."""
    from ray.cluster_utils import Cluster

    def node_args(num_cpus: int, resources: dict) -> dict:
        return {"num_cpus": num_cpus, "resources": resources, "node_ip_address": LOOPBACK,
                "include_dashboard": False, "object_store_memory": 96 * MiB}

    assert not ray.is_initialized(), "another test module left Ray running in this process"
    pin_to_loopback()
    before = descendants(os.getpid())
    c = Cluster(initialize_head=True, head_node_args=node_args(*head))
    try:
        c.workers = [c.add_node(**node_args(*w)) for w in workers]
        c.pids = lambda: descendants(os.getpid()) - before
        yield c
    finally:
        started = descendants(os.getpid()) - before
        ray.shutdown()
        c.shutdown()
        deadline = time.monotonic() + 15
        while started & descendants(os.getpid()) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in started & descendants(os.getpid()):  # leak nothing into later modules
            os.kill(pid, signal.SIGKILL)


@pytest.fixture(scope="session")
def cluster_factory() -> Callable:
    """`loopback_cluster`, for module fixtures."""
    return loopback_cluster
