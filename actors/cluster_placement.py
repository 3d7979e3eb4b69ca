"""The Ray side of placement: the alive nodes' resources, and the serve settings made
concrete and checked against them before anything is deployed (frontend/placement.py decides):
the placement mode, and whether each rank gets a GPU of its own."""
from __future__ import annotations

import dataclasses
import logging

import ray
import ray._private.state as ray_state

from kvtier.policies import StorageBackendKind
from kvtier.frontend.placement import (NodeResources, PlacementMode, RankGpus, check_placement,
                                       describe_offers, needs_of, resolve_gpus,
                                       resolve_mode)
from kvtier.frontend.settings import ServeSettings

log = logging.getLogger(__name__)


def cluster_nodes() -> list[NodeResources]:
    """Every alive node of the cluster this process is connected to."""
    free = ray_state.available_resources_per_node()
    return [NodeResources(n["NodeID"], n["NodeManagerAddress"], dict(n["Resources"]),
                          dict(free.get(n["NodeID"], {})))
            for n in ray.nodes() if n["Alive"]]


def rank_gpus(settings: ServeSettings, nodes: list[NodeResources] | None = None) -> RankGpus:
    """Whether each rank of the deployment asks for a GPU (ONE or NONE): its gpus_per_rank
    resolved against the alive `nodes` (default: the cluster's now). A PlacementError names
    GPU where 1 is asked and the nodes lack GPUs; AUTO leaving GPUs unused is a warning."""
    decision = resolve_gpus(settings.gpus_per_rank, cluster_nodes() if nodes is None else nodes,
                            needs_of(settings))
    if decision.note:
        log.warning("placement: %s", decision.note)
    return decision.gpus


def place(settings: ServeSettings, joined: bool | None) -> ServeSettings:
    """`settings` with a concrete placement (AUTO resolved: `joined` as in
    `resolve_mode`), the ranks' GPUs checked (`rank_gpus`); with RESOURCES, checked against
    the cluster now: a PlacementError names what is short before any actor is created."""
    nodes = cluster_nodes()
    gpus = rank_gpus(settings, nodes)
    needs = needs_of(settings, gpus)
    mode = resolve_mode(settings.placement, joined, nodes, needs)
    if gpus is RankGpus.ONE:
        log.info("placement: one GPU per rank (%d in all)", needs.instances * needs.tp_size)
    if mode is PlacementMode.RESOURCES:
        plan = check_placement(needs, nodes)
        for wait in plan.waits:
            log.warning("placement: %s", wait)
        log.info("placement: namespace actor on %s, instances on %s", plan.head_nodes or "-",
                 plan.instance_slots)
        if settings.storage_backend in (StorageBackendKind.FILE, StorageBackendKind.NIXL) \
                and not settings.l3_root:
            log.warning("placement: l3_root is unset, so L3 goes to a temporary directory on "
                        "each node; instances on different nodes share no pages: set l3_root "
                        "to a directory every node mounts")
    if mode is not settings.placement:
        log.info("placement %s: %s", settings.placement, mode)
    return dataclasses.replace(settings, placement=mode)


def unplaced_message(bundle: dict[str, float], count: int, strategy: str,
                     waited_s: float) -> str:
    """Why `count` bundles like `bundle` are still not placed, with the nodes offering each
    resource they ask for."""
    nodes = cluster_nodes()
    offers = "; ".join(f"{name}: {describe_offers(nodes, name)}" for name in bundle)
    return (f"Ray placed none of {count} bundles of {bundle} ({strategy}) in "
            f"{waited_s:g} s; the nodes' totals: {offers}. Free those resources (other "
            f"deployments' ranks hold them) or start nodes offering them (`ray status` shows "
            f"what is in use)")
