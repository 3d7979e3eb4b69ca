"""The addresses the L3 binds and registers when ranks span hosts (its Ray lookups live here).

- The Mooncake master the namespace actor starts binds `master_host`: the address given, or
  for "auto" the actor's own node address when the Ray cluster has more than one alive node
  at registration, 127.0.0.1 otherwise (on one host nothing outside needs to reach it). The
  decision is made here; backends/mooncake_master.py binds what it is told. A master the
  supervisor restarts keeps its host. A cluster that grows past one node after registration
  keeps a loopback master: set master_host for one that will.
- A rank's Mooncake client registers `local_hostname`: the user's, or when the namespace's
  master is not on loopback, the rank's own node address, so that peers on other hosts can
  dial its segment (never 0.0.0.0: not an address anyone can dial).
- Copies of each Mooncake object (`replica_num`): the number given, or for "auto" 2 when the
  alive nodes at registration are on 2+ hosts (distinct node addresses: several Ray nodes
  on one machine are one host), 1 otherwise. A second copy lives on another segment, so a
  host whose link is cut does not take the only copy of its pages with it (Mooncake places
  copies on different clients, not different hosts: with several ranks per host both can
  land on one host; then such a page is a miss, as with one copy). Decided at registration,
  like the master's host: a cluster that grows later keeps one copy unless set.
"""
from __future__ import annotations

import dataclasses
import ipaddress
import socket

import ray

from kvtier.backends.mooncake_master import LOOPBACK
from kvtier.messages import NamespaceInfo
from kvtier.policies import StorageBackendKind
from kvtier.storage_options import AUTO_HOST, AUTO_REPLICAS, MooncakeOptions


def resolve_master_host(master_host: str, alive_nodes: int, node_address: str) -> str:
    """The address a namespace's master binds: `master_host` unless it is "auto"; then the
    node's address on a multi-node cluster, loopback on one node."""
    if master_host != AUTO_HOST:
        return master_host
    return node_address if alive_nodes > 1 else LOOPBACK


def cluster_master_host(options: MooncakeOptions) -> str:
    """`resolve_master_host` for the node this (namespace actor) process runs on."""
    if options.master_host != AUTO_HOST:
        return options.master_host
    alive = sum(1 for node in ray.nodes() if node.get("Alive"))
    return resolve_master_host(AUTO_HOST, alive, node_address())


def resolve_replica_num(replica_num: int | str, hosts: int) -> int:
    """Copies of each object: `replica_num` unless it is "auto"; then 2 on 2+ hosts, else 1."""
    if replica_num != AUTO_REPLICAS:
        return int(replica_num)
    return 2 if hosts > 1 else 1


def cluster_replica_num(options: MooncakeOptions) -> int:
    """`resolve_replica_num` for the Ray cluster this (namespace actor) process is in."""
    if options.replica_num != AUTO_REPLICAS:
        return int(options.replica_num)
    return resolve_replica_num(AUTO_REPLICAS, cluster_hosts())


def cluster_hosts() -> int:
    """Hosts among the alive nodes: their distinct addresses."""
    return len({node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")})


def node_address() -> str:
    """This process's node address as Ray knows it."""
    return ray.util.get_node_ip_address()


def node_label(address: str) -> str:
    """How errors name a node: its host name and Ray address."""
    return f"{socket.gethostname()} ({address})"


def rank_client_info(info: NamespaceInfo, node_address: str) -> NamespaceInfo:
    """`info` as a rank on `node_address` opens it: a Mooncake client without its own
    `local_hostname` registers the node's address when the master is not on loopback."""
    if info.spec.backend is not StorageBackendKind.MOONCAKE:
        return info
    options = info.storage_options()
    assert isinstance(options, MooncakeOptions)
    if options.local_hostname is not None or options.master_address is None:
        return info
    if is_loopback(options.master_address.rpartition(":")[0]):
        return info
    return dataclasses.replace(info, options={**info.options, "local_hostname": node_address})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: assume another host can reach it
