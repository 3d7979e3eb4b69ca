"""Where a deployment's actors may run on a Ray cluster, checked before anything is created.

On a cluster kvtier joins, the L3 namespace actor goes to a node offering `head_resource`
(`kvtier_head` in cluster.yaml: the head) and every rank asks for one unit of
`instance_resource` (`kvtier_instance`: the workers). Where the cluster has GPUs, every rank
also asks for one GPU of its own (`RankGpus`): its model, its L1 pool and its NCCL group live
there. This module is the pure part: given the alive nodes' resources (`NodeResources`, read
by actors/cluster_placement.py), it says whether the deployment fits (`PlacementPlan`,
`GpuDecision`) or raises a PlacementError that names the resource, the amount needed and the
nodes that offer it.

Why a check before deploying: a placement group Ray cannot satisfy waits silently, so a
missing resource would show up as an instance timing out minutes later.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Mapping, NamedTuple, Sequence

from kvtier.errors import ConfigError, PlacementError
from kvtier.policies import _Choice

if TYPE_CHECKING:
    from kvtier.frontend.settings import ServeSettings

HEAD_RESOURCE = "kvtier_head"
INSTANCE_RESOURCE = "kvtier_instance"
RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")  # not custom resources
RANK_STRATEGY = "STRICT_PACK"  # an instance's TP group meets on 127.0.0.1: one node each
GPU = "GPU"  # Ray's own resource name
_EPS = 1e-9


class PlacementMode(_Choice):
    """Whether the actors ask Ray for the custom resources."""

    AUTO = "auto"  # RESOURCES on a cluster kvtier joined; ANYWHERE on its own local one
    RESOURCES = "resources"  # namespace actor on head_resource, 1 instance_resource per rank
    ANYWHERE = "anywhere"  # no custom resources: any node with the CPUs


class RankGpus(_Choice):
    """Whether each rank asks Ray for a GPU of its own (then Ray shows the rank only that GPU,
    and its model, L1 pool and NCCL group use it)."""

    AUTO = "auto"  # ONE where the alive nodes' GPUs hold every instance's ranks, else NONE
    ONE = "1"  # one GPU per rank; a cluster without enough is a PlacementError before deploying
    NONE = "0"  # CPU ranks, whatever the nodes offer

    @classmethod
    def parse(cls, value: "str | int | _Choice", flag: str) -> "RankGpus":
        """Also the integers 0 and 1 (`gpus_per_rank: 1` in a Serve config)."""
        if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
            value = str(value)
        return super().parse(value, flag)  # type: ignore[return-value]

    @property
    def count(self) -> int:
        """GPUs each rank's bundle asks for (AUTO must be resolved first: `resolve_gpus`)."""
        if self is RankGpus.AUTO:
            raise ConfigError("gpus_per_rank auto has no count until it is resolved against "
                              "the cluster (resolve_gpus)")
        return 1 if self is RankGpus.ONE else 0


class GpuDecision(NamedTuple):
    gpus: RankGpus  # ONE or NONE, never AUTO
    note: str | None  # why AUTO chose NONE on a cluster that has GPUs (worth a warning)


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
    gpus_per_rank: int = 0  # 1: each rank's bundle asks for a GPU too


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


def needs_of(s: "ServeSettings", gpus: RankGpus = RankGpus.NONE) -> PlacementNeeds:
    """What the deployment asks of the cluster, its ranks taking `gpus` (resolved) each."""
    head = s.head_resource if s.storage_backend is not None else None
    return PlacementNeeds(head, s.instance_resource, s.instances, s.tp_size,
                          s.num_cpus_per_rank, gpus.count)


def rank_bundle(cpus: float, gpus: int, resources: Mapping[str, float] | None
                ) -> dict[str, float]:
    """What one rank's placement-group bundle asks Ray for: its CPUs, its GPU when it has
    one (no GPU key at all otherwise), and the custom `resources`."""
    gpu = {GPU: float(gpus)} if gpus > 0 else {}
    return {"CPU": cpus, **gpu, **(resources or {})}


def resolve_gpus(choice: RankGpus, nodes: Sequence[NodeResources], needs: PlacementNeeds
                 ) -> GpuDecision:
    """`choice` made concrete for the alive `nodes`: AUTO is ONE when they hold a GPU for
    every rank (each instance's ranks on one node), else NONE with a note saying why. ONE
    where they do not is a PlacementError naming GPU and the nodes that offer it."""
    if choice is RankGpus.NONE:
        return GpuDecision(RankGpus.NONE, None)
    held = sum(_gpu_instances(n.total, needs.tp_size) for n in nodes)
    if held >= needs.instances:
        return GpuDecision(RankGpus.ONE, None)
    ranks = needs.instances * needs.tp_size
    shortfall = (f"the ranks need {ranks} GPUs ({needs.instances} instances x TP "
                 f"{needs.tp_size}, 1 per rank, each instance's on one node) but the alive "
                 f"nodes' GPUs hold {held} of the {needs.instances} instances: "
                 f"{describe_offers(nodes, GPU)}")
    if choice is RankGpus.AUTO:
        if not any(_amount(n.total, GPU) > 0 for n in nodes):
            return GpuDecision(RankGpus.NONE, None)
        return GpuDecision(RankGpus.NONE, f"{shortfall}; the ranks run on CPUs. Lower "
                           f"instances or tp_size to use the GPUs, or set gpus_per_rank to 0 "
                           f"to silence this")
    raise PlacementError(f"placement: gpus_per_rank is 1: {shortfall}. Start nodes with GPUs "
                         f"(`ray start --num-gpus=N`), lower instances or tp_size, or set "
                         f"gpus_per_rank to 0 for CPU ranks")


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
            f"{needs.tp_size * needs.cpus_per_rank:g} CPU{_gpu_part(needs)} per instance; the "
            f"nodes hold {sum(slots.values())} of the {needs.instances} instances: "
            f"{describe_nodes(nodes, res, needs.gpus_per_rank > 0)}. Give nodes whole "
            f"instances' worth of {res!r}, CPU{' and GPU' if needs.gpus_per_rank else ''}, "
            f"or lower tp_size")
    return PlacementPlan(head_nodes, slots, _waits(needs, nodes))


def instances_held(resources: Mapping[str, float], needs: PlacementNeeds) -> int:
    """Whole instances (tp_size ranks each) that one node's `resources` hold."""
    by_unit = _amount(resources, needs.instance_resource) / needs.tp_size
    cpus = needs.tp_size * needs.cpus_per_rank
    by_cpu = _amount(resources, "CPU") / cpus if cpus > 0 else math.inf
    by_gpu = _gpu_instances(resources, needs.tp_size) if needs.gpus_per_rank > 0 else math.inf
    return int(math.floor(min(by_unit, by_cpu, by_gpu) + _EPS))


def _gpu_instances(resources: Mapping[str, float], tp_size: int) -> int:
    """Whole instances one node's GPUs hold at one GPU per rank."""
    return int(math.floor(_amount(resources, GPU) / tp_size + _EPS))


def _gpu_part(needs: PlacementNeeds) -> str:
    return f" and {needs.tp_size * needs.gpus_per_rank} GPU" if needs.gpus_per_rank else ""


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


def describe_nodes(nodes: Sequence[NodeResources], resource: str, gpus: bool = False) -> str:
    """'10.0.0.11 (kvtier_instance 4 of 4 free, CPU 8 of 8 free), ...' (and GPU, with
    `gpus`)."""
    names = (resource, "CPU", GPU) if gpus else (resource, "CPU")

    def amount(n: NodeResources, name: str) -> str:
        return f"{name} {_amount(n.available, name):g} of {_amount(n.total, name):g} free"
    return ", ".join(f"{name} ({', '.join(amount(n, r) for r in names)})"
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
            f"({describe_nodes(nodes, needs.instance_resource, needs.gpus_per_rank > 0)}): "
            f"the others wait for ranks to end",)


def _amount(resources: Mapping[str, float], name: str | None) -> float:
    return float(resources.get(name, 0.0)) if name else 0.0
