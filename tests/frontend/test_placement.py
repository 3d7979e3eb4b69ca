"""The placement check (frontend/placement.py) on node records, without Ray."""
from __future__ import annotations

import pytest

from kvtier.errors import ConfigError, PlacementError
from kvtier.frontend.placement import (GPU, NodeResources, PlacementMode, PlacementNeeds,
                                       RankGpus, check_placement, head_resources,
                                       needs_of, rank_bundle, rank_resources, resolve_gpus,
                                       resolve_mode)
from kvtier.frontend.settings import ServeSettings


def node(ip: str, free: dict | None = None, node_id: str = "", **total: float) -> NodeResources:
    return NodeResources(node_id or f"id-{ip}", ip, total, total if free is None else free)


HEAD = node("10.0.0.1", CPU=4, kvtier_head=1)
WORKER_A = node("10.0.0.11", CPU=8, kvtier_instance=4)
WORKER_B = node("10.0.0.12", CPU=8, kvtier_instance=4)


def needs(instances: int = 2, tp: int = 2, cpus: float = 0.5,
          head: str | None = "kvtier_head") -> PlacementNeeds:
    return PlacementNeeds(head, "kvtier_instance", instances, tp, cpus)


def test_a_cluster_like_cluster_yaml_holds_the_deployment() -> None:
    plan = check_placement(needs(instances=4, tp=2), [HEAD, WORKER_A, WORKER_B])
    assert plan.head_nodes == ("10.0.0.1",)
    assert plan.instance_slots == {"10.0.0.1": 0, "10.0.0.11": 2, "10.0.0.12": 2}
    assert plan.waits == ()


def test_no_node_offering_the_head_resource_names_the_nodes() -> None:
    with pytest.raises(PlacementError) as err:
        check_placement(needs(), [node("10.0.0.1", CPU=4), WORKER_A])
    msg = str(err.value)
    assert "'kvtier_head'" in msg and "10.0.0.1" in msg and "10.0.0.11" in msg
    assert "--resources='{\"kvtier_head\": 1}'" in msg
    # without L3 there is no namespace actor: the head resource is not needed
    assert check_placement(needs(head=None), [node("10.0.0.1", CPU=4), WORKER_A]).head_nodes == ()


def test_too_few_instance_units_says_how_many_and_where() -> None:
    with pytest.raises(PlacementError) as err:
        check_placement(needs(instances=3, tp=2), [HEAD, WORKER_A])
    msg = str(err.value)
    assert "6 units of 'kvtier_instance'" in msg and "offer 4" in msg
    assert "10.0.0.11 has 4" in msg and "none on 10.0.0.1" in msg
    assert "--resources='{\"kvtier_instance\": N}'" in msg


def test_each_instance_must_fit_on_one_node() -> None:
    # 6 units in all for 2 x TP 3, but 3 + 3 split as 4 + 2: only one instance fits
    nodes = [HEAD, WORKER_A, node("10.0.0.12", CPU=8, kvtier_instance=2)]
    with pytest.raises(PlacementError) as err:
        check_placement(needs(instances=2, tp=3), nodes)
    msg = str(err.value)
    assert "share one node" in msg and "hold 1 of the 2 instances" in msg
    assert "10.0.0.12 (kvtier_instance 2 of 2 free" in msg


def test_cpus_count_per_node_too() -> None:
    short_cpu = node("10.0.0.11", CPU=1, kvtier_instance=4)
    with pytest.raises(PlacementError, match="1.5 CPU per instance"):
        check_placement(needs(instances=1, tp=3), [HEAD, short_cpu])
    assert check_placement(needs(instances=1, tp=3, cpus=0.0), [HEAD, short_cpu])


def test_units_in_use_now_are_a_wait_not_an_error() -> None:
    busy = node("10.0.0.11", {"CPU": 8, "kvtier_instance": 1}, CPU=8, kvtier_instance=4)
    plan = check_placement(needs(instances=2), [HEAD, busy])
    assert plan.waits and "only 0 of 2 instances fit" in plan.waits[0]


def test_nodes_on_one_address_are_told_apart() -> None:
    nodes = [node("127.0.0.1", node_id="aaaaaaaa11", CPU=1, kvtier_head=1),
             node("127.0.0.1", node_id="bbbbbbbb22", CPU=1, kvtier_instance=1)]
    with pytest.raises(PlacementError) as err:
        check_placement(needs(instances=2, tp=1), nodes)
    assert "127.0.0.1 node bbbbbbbb has 1" in str(err.value)


def test_no_alive_node_is_an_error() -> None:
    with pytest.raises(PlacementError, match="no alive node"):
        check_placement(needs(), [])


def test_auto_is_resources_on_a_joined_or_multi_node_cluster() -> None:
    one = [node("127.0.0.1", CPU=4)]
    auto = PlacementMode.AUTO
    assert resolve_mode(auto, True, one, needs()) is PlacementMode.RESOURCES
    assert resolve_mode(auto, False, [HEAD, WORKER_A], needs()) is PlacementMode.ANYWHERE
    assert resolve_mode(auto, None, one, needs()) is PlacementMode.ANYWHERE
    assert resolve_mode(auto, None, [HEAD, WORKER_A], needs()) is PlacementMode.RESOURCES
    offers = [node("127.0.0.1", CPU=4, kvtier_instance=4)]
    assert resolve_mode(auto, None, offers, needs()) is PlacementMode.RESOURCES
    explicit = PlacementMode.ANYWHERE
    assert resolve_mode(explicit, True, [HEAD, WORKER_A], needs()) is explicit


def test_settings_carry_the_placement() -> None:
    s = ServeSettings(model="tiny", instances=3, tp_size=2, placement="resources",
                      instance_resource="gpu_box", storage_backend=None)
    assert s.to_mapping()["placement"] == "resources"
    assert ServeSettings.from_mapping(s.to_mapping()).placement is PlacementMode.RESOURCES
    assert rank_resources(s) == {"gpu_box": 1} and head_resources(s) == {"kvtier_head": 1}
    assert needs_of(s) == PlacementNeeds(None, "gpu_box", 3, 2, 0.5)  # no L3: no head needed
    assert rank_resources(ServeSettings(placement="anywhere")) is None
    with pytest.raises(ConfigError, match="Ray's own"):
        ServeSettings(instance_resource="CPU")
    with pytest.raises(ConfigError, match="placement"):
        ServeSettings(placement="everywhere")


GPU_A = node("10.0.0.21", CPU=8, GPU=2, kvtier_instance=2)
GPU_B = node("10.0.0.22", CPU=8, GPU=2, kvtier_instance=2)
BUNDLE = {"CPU": 0.5, "kvtier_instance": 1}  # what a CPU rank's bundle asked before GPUs


def bundle_for(choice: RankGpus, nodes: list[NodeResources], need: PlacementNeeds
               ) -> dict[str, float]:
    return rank_bundle(0.5, resolve_gpus(choice, nodes, need).gpus.count, {"kvtier_instance": 1})


def test_auto_gives_each_rank_a_gpu_where_the_cluster_has_them() -> None:
    decision = resolve_gpus(RankGpus.AUTO, [HEAD, GPU_A, GPU_B], needs(instances=2, tp=2))
    assert decision == (RankGpus.ONE, None)
    assert bundle_for(RankGpus.AUTO, [HEAD, GPU_A, GPU_B], needs()) == {**BUNDLE, GPU: 1.0}
    assert bundle_for(RankGpus.ONE, [GPU_A], needs(instances=1)) == {**BUNDLE, GPU: 1.0}


def test_cpu_only_cluster_bundles_ask_for_no_gpu() -> None:
    assert resolve_gpus(RankGpus.AUTO, [HEAD, WORKER_A], needs()) == (RankGpus.NONE, None)
    got = bundle_for(RankGpus.AUTO, [HEAD, WORKER_A], needs())
    assert got == BUNDLE and GPU not in got and list(got) == list(BUNDLE)  # same as before
    assert rank_bundle(0.5, 0, None) == {"CPU": 0.5}


def test_explicit_zero_on_a_gpu_cluster_asks_for_none() -> None:
    assert resolve_gpus(RankGpus.NONE, [GPU_A, GPU_B], needs()) == (RankGpus.NONE, None)
    assert GPU not in bundle_for(RankGpus.NONE, [GPU_A, GPU_B], needs())


def test_asking_for_gpus_on_a_cpu_only_cluster_names_gpu() -> None:
    with pytest.raises(PlacementError) as err:
        resolve_gpus(RankGpus.ONE, [HEAD, WORKER_A], needs())
    msg = str(err.value)
    assert "gpus_per_rank is 1" in msg and "4 GPUs" in msg and "no node has 'GPU'" in msg
    assert "--num-gpus" in msg and "gpus_per_rank to 0" in msg


def test_each_instance_needs_its_gpus_on_one_node() -> None:
    # 4 GPUs in all, but 2 + 2 cannot hold one TP 3 instance's ranks on one node
    with pytest.raises(PlacementError, match="hold 0 of the 1 instances"):
        resolve_gpus(RankGpus.ONE, [GPU_A, GPU_B], needs(instances=1, tp=3))
    # AUTO leaves too few GPUs unused and says why, instead of failing
    decision = resolve_gpus(RankGpus.AUTO, [GPU_A], needs(instances=2, tp=2))
    assert decision.gpus is RankGpus.NONE and "run on CPUs" in decision.note
    assert "10.0.0.21 has 2" in decision.note


def test_gpus_count_in_the_resources_check() -> None:
    one_gpu = node("10.0.0.21", CPU=8, GPU=1, kvtier_instance=4)
    gpu_needs = needs(instances=2, tp=1)._replace(gpus_per_rank=1)
    with pytest.raises(PlacementError) as err:
        check_placement(gpu_needs, [HEAD, one_gpu])
    assert "0.5 CPU and 1 GPU per instance" in str(err.value)
    assert "GPU 1 of 1 free" in str(err.value)
    assert check_placement(gpu_needs, [HEAD, GPU_A]).instance_slots["10.0.0.21"] == 2
    assert check_placement(needs(instances=2, tp=1), [HEAD, one_gpu])  # CPU ranks: fits


def test_gpus_per_rank_values() -> None:
    assert RankGpus.parse(1, "gpus_per_rank") is RankGpus.ONE
    assert RankGpus.parse("0", "gpus_per_rank") is RankGpus.NONE
    assert RankGpus.parse("AUTO", "gpus_per_rank") is RankGpus.AUTO
    for bad in (2, True, 0.5, "two"):
        with pytest.raises(ConfigError, match=f"gpus_per_rank: {bad!r} is not one of"):
            RankGpus.parse(bad, "gpus_per_rank")
    with pytest.raises(ConfigError, match="resolve"):
        RankGpus.AUTO.count
    s = ServeSettings(model="tiny", storage_backend=None)
    assert s.gpus_per_rank is RankGpus.AUTO  # the default
    assert ServeSettings(model="tiny", storage_backend=None, gpus_per_rank=0).gpus_per_rank is RankGpus.NONE
    assert needs_of(s, RankGpus.ONE).gpus_per_rank == 1 and needs_of(s).gpus_per_rank == 0
