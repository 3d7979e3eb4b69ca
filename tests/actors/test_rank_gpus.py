"""Whether ranks ask Ray for GPUs, decided on node records (no Ray cluster, no GPU needed)."""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvtier.actors.cluster_placement import rank_gpus
from kvtier.actors.rank_actor import Rank, RankSettings
from kvtier.config import HiCacheConfig
from kvtier.engine.weight_sources import TinyWeights
from kvtier.errors import ConfigError, PlacementError
from kvtier.frontend.placement import NodeResources, RankGpus
from kvtier.frontend.settings import ServeSettings

SETTINGS = ServeSettings(model="tiny", instances=2, tp_size=2, storage_backend=None)


def node(ip: str, **total: float) -> NodeResources:
    return NodeResources(f"id-{ip}", ip, total, total)


def test_the_cluster_decides_where_gpus_per_rank_is_auto(caplog) -> None:
    gpu_nodes = [node("10.0.0.1", CPU=8, GPU=4)]
    assert rank_gpus(SETTINGS, gpu_nodes) is RankGpus.ONE
    assert rank_gpus(SETTINGS, [node("10.0.0.1", CPU=8)]) is RankGpus.NONE
    with caplog.at_level(logging.WARNING, logger="kvtier.actors.cluster_placement"):
        assert rank_gpus(SETTINGS, [node("10.0.0.1", CPU=8, GPU=2)]) is RankGpus.NONE
    assert "run on CPUs" in caplog.text  # GPUs left unused: said, not silent


def test_gpus_asked_of_a_cpu_only_cluster_fail_naming_gpu() -> None:
    with pytest.raises(PlacementError, match="'GPU'"):
        rank_gpus(dataclasses.replace(SETTINGS, gpus_per_rank=RankGpus.ONE),
                  [node("10.0.0.1", CPU=8)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_a_gpu_rank_without_cuda_says_what_to_do() -> None:
    settings = RankSettings(TinyWeights(), HiCacheConfig(page_size=16), gpu=True)
    with pytest.raises(ConfigError, match="gpus_per_rank to 0"):
        Rank(0, 1, "tcp://127.0.0.1:1", settings)
