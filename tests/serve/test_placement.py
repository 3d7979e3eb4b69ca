"""The placement check (serve/placement.py) on node records, without Ray."""
from __future__ import annotations

import pytest

from kvtier.errors import ConfigError, PlacementError
from kvtier.serve.placement import (NodeResources, PlacementMode, PlacementNeeds,
                                    check_placement, head_resources, needs_of, rank_resources,
                                    resolve_mode)
from kvtier.serve.settings import ServeSettings


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
                      instance_resource="gpu_box", l3="none")
    assert s.to_mapping()["placement"] == "resources"
    assert ServeSettings.from_mapping(s.to_mapping()).placement is PlacementMode.RESOURCES
    assert rank_resources(s) == {"gpu_box": 1} and head_resources(s) == {"kvtier_head": 1}
    assert needs_of(s) == PlacementNeeds(None, "gpu_box", 3, 2, 0.5)  # no L3: no head needed
    assert rank_resources(ServeSettings(placement="anywhere")) is None
    with pytest.raises(ConfigError, match="Ray's own"):
        ServeSettings(instance_resource="CPU")
    with pytest.raises(ConfigError, match="placement"):
        ServeSettings(placement="everywhere")
