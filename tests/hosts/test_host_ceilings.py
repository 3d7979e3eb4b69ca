"""The cross-host ceilings (kvtier.bench.host_ceilings) on one 3-host network: a TCP stream
and raw Mooncake reads between hosts give positive rates, the readers get back every byte
the writer stored, and every process listens on its host's address or loopback only, except
the two wildcard listeners each Mooncake client opens (no option binds them)."""
from __future__ import annotations

import pytest

from kvtier.bench.host_ceilings import CeilingError, mooncake_read_gbps, tcp_gbps
from kvtier.hosts.network import host_network
from kvtier.netcheck import Listener, listening

KiB, MiB = 1 << 10, 1 << 20
# Mooncake 0.3.13 clients (tcp, P2PHANDSHAKE) listen on two sockets that no option binds to
# one address (see backends/mooncake_backend.py): the transfer engine's P2P handshake
# listener (transfer_engine_impl.cpp) on 0.0.0.0 and the TcpTransport data listener
# (tcp_transport.cpp) on `::`. `local_hostname` only decides the address peers dial.
MOONCAKE_CLIENT_WILDCARDS = ["0.0.0.0", "::"]


@pytest.fixture(scope="module")
def net():
    with host_network(3) as network:
        yield network


def test_tcp_stream_between_hosts(net) -> None:
    assert tcp_gbps(net.hosts[1], net.hosts[2], 32 * MiB) > 0


def test_tcp_refuses_a_size_it_cannot_time(net) -> None:
    with pytest.raises(CeilingError, match="nbytes >="):
        tcp_gbps(net.hosts[1], net.hosts[2], 1 * MiB)


def test_mooncake_reads_from_another_hosts_segment(net) -> None:
    master, writer, reader = net.hosts
    seen: dict[str, list[Listener]] = {}

    def probe() -> None:
        seen.update({h.address: listening(h.pids()) for h in net.hosts})

    got = mooncake_read_gbps(master, writer, reader, object_bytes=256 * KiB, objects=16,
                             readers=2, probe=probe)
    # the readers compared every object with the writer's pattern (a mismatch raises)
    assert got.gbps > 0 and got.seconds > 0
    assert (got.bytes, got.objects, got.object_bytes) == (16 * 256 * KiB, 16, 256 * KiB)
    # the master binds its host's address only
    assert seen[master.address] and {l.host for l in seen[master.address]} == {master.address}
    # each client (one writer, two readers): its wildcard pair, nothing else off its address
    for host, clients in ((writer, 1), (reader, 2)):
        pids = {l.pid for l in seen[host.address]}
        assert len(pids) == clients, seen[host.address]
        for pid in pids:
            stray = sorted(l.host for l in seen[host.address]
                           if l.pid == pid and l.host not in (host.address, "127.0.0.1"))
            assert stray == sorted(MOONCAKE_CLIENT_WILDCARDS), seen[host.address]


def test_mooncake_arguments_are_checked(net) -> None:
    with pytest.raises(CeilingError, match="readers <= objects"):
        mooncake_read_gbps(*net.hosts, object_bytes=1024, objects=1, readers=2)
