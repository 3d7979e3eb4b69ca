"""Shared pieces of the actor tests."""
from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import ray

from kvtier.actors.instance import Instance
from kvtier.actors.rank_actor import Rank, RankSettings
from kvtier.actors.ray_env import LOOPBACK, pin_to_loopback, shutdown_local_ray, start_local_ray
from kvtier.netcheck import descendants

MiB = 1 << 20
SHARED_RAY_CPUS = 2
_shared_ray: list[bool] = []  # [True] while the shared local Ray runs


@pytest.fixture(scope="module")
def shared_ray() -> None:
    """A 2-CPU local Ray cluster that consecutive modules asking for this fixture share
    (starting one is most of a small module's setup); each closes the actors it made. It
    stops at the end of a module when the next test does not ask for it
    (pytest_runtest_teardown below), so modules that start Ray themselves or check a fresh
    cluster's processes find none running."""
    if not _shared_ray:
        start_local_ray(num_cpus=SHARED_RAY_CPUS)
        _shared_ray.append(True)


def pytest_collection_modifyitems(items):
    """Run this directory's modules that use the shared Ray one after another, where the first
    of them is (the rest keep their order), so that it starts once."""
    here = Path(__file__).parent
    mine = [i for i in items if Path(i.path).is_relative_to(here)]
    users = {i.module for i in mine if "shared_ray" in getattr(i, "fixturenames", ())}
    if not users:
        return
    moved = [i for i in mine if getattr(i, "module", None) in users]
    first, taken = items.index(moved[0]), set(moved)
    rest = [i for i in items if i not in taken]
    items[:] = rest[:first] + moved + rest[first:]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    try:
        return (yield)  # the fixtures' teardown first: they close their actors in this Ray
    finally:
        if _shared_ray and not _stays_on_shared_ray(item, nextitem):
            _shared_ray.clear()
            shutdown_local_ray()


def _stays_on_shared_ray(item, nextitem) -> bool:
    """The next test is in the same module, or asks for the shared Ray itself."""
    if nextitem is None:
        return False
    return getattr(nextitem, "module", None) is item.module \
        or "shared_ray" in nextitem.fixturenames


@contextlib.contextmanager
def local_instance(settings: RankSettings, tp_size: int = 2,
                   rank_class: type[Rank] = Rank) -> Iterator[Instance]:
    """A TP instance on the shared local Ray cluster, closed afterwards."""
    assert _shared_ray, "local_instance runs on the shared_ray fixture's cluster"
    with Instance(settings, tp_size=tp_size, ready_timeout_s=90.0, step_timeout_s=30.0,
                  rank_class=rank_class) as inst:
        yield inst


@pytest.fixture(scope="module")
def instance_factory(shared_ray) -> Callable:
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
