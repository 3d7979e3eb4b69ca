"""Where a deployment's actors may run on a Ray cluster, checked before anything is created.

On a cluster kvtier joins, the L3 namespace actor goes to a node offering `head_resource`
(`kvtier_head` in cluster.yaml: the head) and every rank asks for one unit of
`instance_resource` (`kvtier_instance`: the workers). This module is the pure part: given the
alive nodes' resources (`NodeResources`, read by actors/cluster_placement.py), it says whether
the deployment fits (`PlacementPlan`) or raises a PlacementError that names the resource, the
amount needed and the nodes that offer it.

Why a check before deploying: a placement group Ray cannot satisfy waits silently, so a
missing resource would show up as an instance timing out minutes later.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

from kvtier.errors import ConfigError, PlacementError
from kvtier.policies import _Choice

if TYPE_CHECKING:
    from kvtier.serve.settings import ServeSettings

HEAD_RESOURCE = "kvtier_head"
INSTANCE_RESOURCE = "kvtier_instance"
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")  # not custom resources
RANK_STRATEGY = "STRICT_PACK"  # an instance's TP group meets on 127.0.0.1: one node each
_EPS = 1e-9


class PlacementMode(_Choice):
    """Whether the actors ask Ray for the custom resources."""

    AUTO = "auto"  # RESOURCES on a cluster kvtier joined; ANYWHERE on its own local one
    RESOURCES = "resources"  # namespace actor on head_resource, 1 instance_resource per rank
    ANYWHERE = "anywhere"  # no custom resources: any node with the CPUs


class NodeResources(NamedTuple):
    """One alive Ray node: its address and its resources, all and unused now."""

    node_id: str
    ip: str
    total: Mapping[str, float]
    available: Mapping[str, float]


class PlacementNeeds(NamedTuple):
    head_resource: str | None  # None: no namespace actor to place (no L3)
    instance_resource: str
    instances: int
    tp_size: int
    cpus_per_rank: float


class PlacementPlan(NamedTuple):
    head_nodes: tuple[str, ...]  # nodes offering head_resource (empty when not needed)
    instance_slots: dict[str, int]  # node -> whole instances its resources hold
    waits: tuple[str, ...]  # shortfalls that only units in use now cause: the ranks wait


def check_resource_name(value: object, name: str) -> None:
    if not isinstance(value, str) or not value.strip() or len(value) > 256:
        raise ConfigError(f"{name}: expected a custom Ray resource's name (as in `ray start "
                          f"--resources='{{\"kvtier_instance\": 4}}'`), got {value!r}")
    if value in RAY_RESOURCES:
        raise ConfigError(f"{name}: {value!r} is one of Ray's own resources; name a custom "
                          f"one that only the intended nodes offer")


def needs_of(s: "ServeSettings") -> PlacementNeeds:
    head = s.head_resource if s.storage_backend is not None else None
    return PlacementNeeds(head, s.instance_resource, s.instances, s.tp_size,
                          s.num_cpus_per_rank)


def rank_resources(s: "ServeSettings") -> dict[str, float] | None:
    """The custom resources each rank's bundle asks for."""
    return {s.instance_resource: 1} if s.placement is PlacementMode.RESOURCES else None


def head_resources(s: "ServeSettings") -> dict[str, float] | None:
    """The custom resources the namespace actor asks for."""
    return {s.head_resource: 1} if s.placement is PlacementMode.RESOURCES else None


def resolve_mode(mode: PlacementMode, joined: bool | None, nodes: Sequence[NodeResources],
                 needs: PlacementNeeds) -> PlacementMode:
    """AUTO made concrete. `joined`: True for `kvtier serve --address`, False for the local
    cluster `kvtier serve` started, None when unknown (a Serve config): then a cluster of
    more than one node, or one whose nodes offer either resource, is treated as joined."""
    if mode is not PlacementMode.AUTO:
        return mode
    if joined is None:
        offered = any(_amount(n.total, r) > 0 for n in nodes
                      for r in (needs.head_resource, needs.instance_resource) if r)
        joined = len(nodes) > 1 or offered
    return PlacementMode.RESOURCES if joined else PlacementMode.ANYWHERE


def check_placement(needs: PlacementNeeds, nodes: Sequence[NodeResources]) -> PlacementPlan:
    """The plan if the alive `nodes` can hold the namespace actor and every instance's ranks
    (each instance's on one node); else a PlacementError saying what is short and where."""
    if not nodes:
        raise PlacementError("placement: the Ray cluster has no alive node; start one and retry")
    head_nodes: tuple[str, ...] = ()
    if needs.head_resource:
        head_nodes = tuple(name for name, n in zip(node_names(nodes), nodes)
                           if _amount(n.total, needs.head_resource) >= 1)
        if not head_nodes:
            raise PlacementError(
                f"placement: no alive node offers the resource {needs.head_resource!r} that "
                f"the L3 namespace actor needs (1 unit); "
                f"{describe_offers(nodes, needs.head_resource)}. Start the head with "
                f"`ray start --head --resources='{{\"{needs.head_resource}\": 1}}'` (as "
                f"cluster.yaml does), set head_resource to a resource one node offers, or "
                f"set placement to anywhere")
    res, ranks = needs.instance_resource, needs.instances * needs.tp_size
    offered = sum(_amount(n.total, res) for n in nodes)
    if offered + _EPS < ranks:
        raise PlacementError(
            f"placement: the ranks need {ranks} units of {res!r} ({needs.instances} instances "
            f"x TP {needs.tp_size}, 1 per rank) but the alive nodes offer {offered:g}: "
            f"{describe_offers(nodes, res)}. Start (more) worker nodes with `ray start "
            f"--address=<head>:6379 --resources='{{\"{res}\": N}}'` (as cluster.yaml does), "
            f"or lower instances or tp_size")
    slots = {name: instances_held(n.total, needs) for name, n in zip(node_names(nodes), nodes)}
    if sum(slots.values()) < needs.instances:
        raise PlacementError(
            f"placement: each instance's {needs.tp_size} ranks must share one node (their TP "
            f"group meets on 127.0.0.1), so a node needs {needs.tp_size} units of {res!r} and "
            f"{needs.tp_size * needs.cpus_per_rank:g} CPU per instance; the nodes hold "
            f"{sum(slots.values())} of the {needs.instances} instances: "
            f"{describe_nodes(nodes, res)}. Give nodes whole instances' worth of {res!r} and "
            f"CPU, or lower tp_size")
    return PlacementPlan(head_nodes, slots, _waits(needs, nodes))


def instances_held(resources: Mapping[str, float], needs: PlacementNeeds) -> int:
    """Whole instances (tp_size ranks each) that one node's `resources` hold."""
    by_unit = _amount(resources, needs.instance_resource) / needs.tp_size
    cpus = needs.tp_size * needs.cpus_per_rank
    by_cpu = _amount(resources, "CPU") / cpus if cpus > 0 else math.inf
    return int(math.floor(min(by_unit, by_cpu) + _EPS))


def describe_offers(nodes: Sequence[NodeResources], resource: str) -> str:
    """'10.0.0.11 has 4, 10.0.0.12 has 2' (and the nodes without it)."""
    named = list(zip(node_names(nodes), nodes))
    have = [f"{name} has {_amount(n.total, resource):g}" for name, n in named
            if _amount(n.total, resource) > 0]
    lack = [name for name, n in named if _amount(n.total, resource) <= 0]
    parts = have or [f"no node has {resource!r}"]
    if lack and have:
        parts.append(f"none on {', '.join(lack)}")
    elif lack:
        parts.append(f"alive: {', '.join(lack)}")
    return "; ".join(parts)


def describe_nodes(nodes: Sequence[NodeResources], resource: str) -> str:
    """'10.0.0.11 (kvtier_instance 4 of 4 free, CPU 8 of 8 free), ...'."""
    def amount(n: NodeResources, name: str) -> str:
        return f"{name} {_amount(n.available, name):g} of {_amount(n.total, name):g} free"
    return ", ".join(f"{name} ({amount(n, resource)}, {amount(n, 'CPU')})"
                     for name, n in zip(node_names(nodes), nodes))


def node_names(nodes: Sequence[NodeResources]) -> list[str]:
    """Each node's address, with its id's first 8 digits where addresses repeat (several
    nodes on one machine)."""
    ips = [n.ip for n in nodes]
    return [n.ip if ips.count(n.ip) == 1 else f"{n.ip} node {n.node_id[:8]}" for n in nodes]


def _waits(needs: PlacementNeeds, nodes: Sequence[NodeResources]) -> tuple[str, ...]:
    """Instances that fit the totals but not what is free now: they wait for ranks to end.
    (A used head unit is not one: an existing namespace actor holds it and is reused.)"""
    free = sum(instances_held(n.available, needs) for n in nodes)
    if free >= needs.instances:
        return ()
    return (f"only {free} of {needs.instances} instances fit in the resources free now "
            f"({describe_nodes(nodes, needs.instance_resource)}): the others wait for "
            f"ranks to end",)


def _amount(resources: Mapping[str, float], name: str | None) -> float:
    return float(resources.get(name, 0.0)) if name else 0.0
