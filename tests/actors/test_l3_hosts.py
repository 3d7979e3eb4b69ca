"""Where the L3 binds when ranks span hosts: the master's host, the ranks' client address.

Only loopback is bound here; binding other addresses (198.18.x in network namespaces) is
another suite's job. The decisions themselves are pure functions, checked with any address.
"""
from __future__ import annotations

import pytest

from kvtier.actors.l3 import hosts as l3_hosts
from kvtier.actors.l3.hosts import (is_loopback, rank_client_info, resolve_master_host,
                                    resolve_replica_num)
from kvtier.actors.l3.namespace_actor import FakeNamespaceClient
from kvtier.actors.l3.namespace_service import NamespaceService
from kvtier.errors import ConfigError
from kvtier.messages import NamespaceInfo, NamespaceSpec
from kvtier.netcheck import listening
from kvtier.storage_options import (AUTO_HOST, AUTO_REPLICAS, MooncakeOptions,
                                    parse_storage_options)
from kvtier.policies import StorageBackendKind

LOOPBACK = "127.0.0.1"
NODE = "198.18.0.2"  # never bound here: only compared
MC = StorageBackendKind.MOONCAKE
NO_SEGMENTS = {"global_segment_size_bytes": 0, "local_buffer_size_bytes": 0}


# ---- options -----------------------------------------------------------------------------

def test_master_host_defaults_to_auto_and_takes_an_ipv4_address():
    assert MooncakeOptions().master_host == AUTO_HOST
    assert MooncakeOptions().local_hostname is None  # the rank decides (below)
    assert parse_storage_options(MC, {"master_host": "10.1.2.3"}).master_host == "10.1.2.3"
    assert parse_storage_options(MC, {"master_host": LOOPBACK}).master_host == LOOPBACK


@pytest.mark.parametrize("value, word", [
    ("0.0.0.0", "not the address of one interface"),  # every interface: never
    ("224.0.0.1", "not the address of one interface"),
    ("255.255.255.255", "not the address of one interface"),
    ("head-node", "not an IPv4 address"),
    ("::1", "without '/'|not an IPv4 address"),
    ("10.0.0.1:5000", "not an IPv4 address"),
    ("", "must not be empty"),
    (7, "expected a string"),
])
def test_bad_master_hosts_are_refused(value, word):
    with pytest.raises(ConfigError, match=f"master_host.*({word})"):
        parse_storage_options(MC, {"master_host": value})


def test_master_host_with_a_given_master_is_a_conflict():
    with pytest.raises(ConfigError, match="drop master_host, or drop master_address"):
        MooncakeOptions(master_address="10.0.0.1:5000", master_host="10.0.0.1")
    MooncakeOptions(master_address="10.0.0.1:5000")  # auto: nothing to decide


# ---- decisions -----------------------------------------------------------------------------

@pytest.mark.parametrize("option, nodes, expected", [
    (AUTO_HOST, 1, LOOPBACK),  # one host: loopback stays the default
    (AUTO_HOST, 2, NODE),  # ranks can span hosts: the actor's node address
    (AUTO_HOST, 0, LOOPBACK),
    ("10.9.8.7", 1, "10.9.8.7"),  # given: bound as is
    ("10.9.8.7", 3, "10.9.8.7"),
])
def test_the_master_host_decision(option, nodes, expected):
    assert resolve_master_host(option, nodes, NODE) == expected


def mooncake_info(**options) -> NamespaceInfo:
    spec = NamespaceSpec("org/model", "t", "fp", MC, dict(NO_SEGMENTS))
    return NamespaceInfo(spec.namespace, spec, {**NO_SEGMENTS, **options}, 1)


def test_a_rank_registers_its_node_address_when_the_master_is_not_on_loopback():
    remote = rank_client_info(mooncake_info(master_address=f"{NODE}:5000"), "198.18.0.3")
    assert remote.options["local_hostname"] == "198.18.0.3"
    assert remote.storage_options().local_hostname == "198.18.0.3"
    for info in (mooncake_info(master_address=f"{LOOPBACK}:5000"),  # one host: unchanged
                 mooncake_info(master_address="localhost:5000"),
                 mooncake_info(master_address=f"{NODE}:5000", local_hostname="10.0.0.9")):
        assert rank_client_info(info, "198.18.0.3") is info  # the user's choice stands
    spec = NamespaceSpec("org/model", "t", "fp", "file", {"root_dir": "/data/kv"})
    file_info = NamespaceInfo(spec.namespace, spec, dict(spec.options))
    assert rank_client_info(file_info, "198.18.0.3") is file_info


def test_loopback_names():
    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("localhost")
    assert is_loopback("[::1]") and not is_loopback(NODE) and not is_loopback("head-node")


# ---- the service binds what it decides, and keeps it over master restarts -----------------

class HostRecorder:
    def __init__(self, host: str) -> None:
        self.host, self.asked = host, []

    def __call__(self, options: MooncakeOptions) -> str:
        self.asked.append(options.master_host)
        return self.host


class DecidingClient(FakeNamespaceClient):
    """A fake client whose service asks `decide` where a master binds (as the actor asks
    actors/l3/hosts.cluster_master_host)."""

    def __init__(self, decide) -> None:
        self.service = NamespaceService(None, master_host=decide)


@pytest.mark.parametrize("options", [{}, {"master_host": LOOPBACK}])
def test_the_service_binds_the_decided_host_and_keeps_it_on_restart(options):
    pytest.importorskip("mooncake.store")
    decide = HostRecorder(LOOPBACK)
    client = DecidingClient(decide)
    spec = NamespaceSpec("org/model", f"hosts-{len(options)}", "fp", MC,
                         {**NO_SEGMENTS, **options})
    try:
        info = client.register(spec)
        assert decide.asked == [options.get("master_host", AUTO_HOST)]
        master = client.service._masters[spec.namespace]
        assert master.host == LOOPBACK and info.options["master_address"] == master.address
        assert f"--rpc_address={LOOPBACK}" in master.command()
        assert f"--metrics_host={LOOPBACK}" in master.command()
        assert {ip for ip, _, _ in listening({master.pid})} == {LOOPBACK}
        master.proc.kill()
        master.proc.wait(5)
        assert client.service.supervise() == 1
        again = client.service._masters[spec.namespace]
        assert again.host == LOOPBACK and again.pid != master.pid
        assert {ip for ip, _, _ in listening({again.pid})} == {LOOPBACK}
        assert decide.asked == [options.get("master_host", AUTO_HOST)]  # not asked again
    finally:
        client.close()


# ---- copies of each object: one per host that may go away, up to two -----------------------

def test_replica_num_defaults_to_auto_and_takes_a_small_count():
    assert MooncakeOptions().replica_num == AUTO_REPLICAS and MooncakeOptions().copies == 1
    assert parse_storage_options(MC, {"replica_num": 3}).copies == 3


@pytest.mark.parametrize("value", [0, -1, 17, "2", "two", True, 2.0, None])
def test_bad_replica_nums_are_refused(value):
    with pytest.raises(ConfigError, match="replica_num"):
        parse_storage_options(MC, {"replica_num": value})


@pytest.mark.parametrize("option, hosts, expected", [
    (AUTO_REPLICAS, 1, 1),  # one host: a second copy would die with the first
    (AUTO_REPLICAS, 0, 1),
    (AUTO_REPLICAS, 2, 2),  # a host may go away: keep a copy elsewhere
    (AUTO_REPLICAS, 5, 2),
    (1, 3, 1),  # given: as is
    (3, 1, 3),
])
def test_the_replica_decision(option, hosts, expected):
    assert resolve_replica_num(option, hosts) == expected


def test_hosts_are_the_distinct_addresses_of_alive_nodes(monkeypatch):
    nodes = [{"Alive": True, "NodeManagerAddress": "198.18.0.1"},
             {"Alive": True, "NodeManagerAddress": "198.18.0.2"},
             {"Alive": True, "NodeManagerAddress": "198.18.0.2"},  # two nodes, one machine
             {"Alive": False, "NodeManagerAddress": "198.18.0.3"}]
    monkeypatch.setattr(l3_hosts.ray, "nodes", lambda: nodes)
    assert l3_hosts.cluster_hosts() == 2
    assert l3_hosts.cluster_replica_num(MooncakeOptions()) == 2
    assert l3_hosts.cluster_replica_num(MooncakeOptions(replica_num=1)) == 1
    monkeypatch.setattr(l3_hosts.ray, "nodes", lambda: nodes[1:3])
    assert l3_hosts.cluster_replica_num(MooncakeOptions()) == 1


class CopiesClient(FakeNamespaceClient):
    """A fake client whose service asks `decide` how many copies (as the actor asks
    actors/l3/hosts.cluster_replica_num)."""

    def __init__(self, decide) -> None:
        self.service = NamespaceService(None, replica_num=decide)


def test_the_service_gives_ranks_the_decided_copies():
    """The spec keeps "auto" (a restarted actor decides again); what the ranks open has the
    count the actor decided, and their clients put that many copies."""
    pytest.importorskip("mooncake.store")
    asked = []

    def decide(options: MooncakeOptions) -> int:
        asked.append(options.replica_num)
        return 2

    client = CopiesClient(decide)
    spec = NamespaceSpec("org/model", "copies", "fp", MC, dict(NO_SEGMENTS))
    try:
        info = client.register(spec)
        assert asked == [AUTO_REPLICAS] and "replica_num" not in spec.options
        assert info.options["replica_num"] == 2 and info.storage_options().copies == 2
    finally:
        client.close()
