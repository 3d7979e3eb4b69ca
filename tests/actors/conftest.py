"""Shared pieces of the actor tests."""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest

from kvtier.actors.instance import Instance
from kvtier.actors.rank_actor import RankCache, RankSettings
from kvtier.actors.ray_env import shutdown_local_ray, start_local_ray


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
