"""The harness itself: hosts reach each other and the root's veth over the bridge, nothing
else is routed, private mounts differ per host, and `down` stops every process by PID and
deletes the namespaces and veths."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from eventually import eventually

from kvtier.hosts.network import HostNetwork, host_network
from kvtier.hosts.ray_nodes import private_tmp, wait_port

ECHO = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 9911)); s.listen();"
        "c,_=s.accept(); c.sendall(c.recv(64)); c.close()")
CONNECT = ("import socket,sys; c=socket.create_connection((sys.argv[1], 9911), timeout=5);"
           "c.sendall(b'ping'); print(c.recv(64).decode())")


def test_hosts_reach_each_other_and_nothing_else_is_routed(tmp_path) -> None:
    with host_network(2, private_tmp(tmp_path, 2)) as net:
        h1, h2 = net.hosts
        assert h1.address != h2.address and h1.address.startswith("198.18.")
        server = h1.popen([sys.executable, "-c", ECHO, h1.address])
        assert wait_port(h1.address, 9911, 10)  # the root's veth reaches host 1
        # now host 2 talks to host 1
        server.wait(5)  # wait_port's connection consumed the first accept
        server = h1.popen([sys.executable, "-c", ECHO, h1.address])

        def connected():  # refused until the server listens
            out = h2.run([sys.executable, "-c", CONNECT, h1.address], check=False)
            return out if out.returncode == 0 else None

        out = eventually(connected, 10, "host 2 reached host 1's echo server", interval_s=0.1)
        assert out.stdout.strip() == "ping"
        routes = h2.run(["ip", "route"]).stdout.strip().splitlines()
        assert routes == [f"{net.subnet} dev {h2.netns}-e proto kernel scope link src "
                          f"{h2.address}"], routes
        addrs = h2.run(["ip", "-o", "-4", "addr"]).stdout
        assert "127.0.0.1" in addrs and h2.address in addrs and addrs.count("inet ") == 2
        # private /tmp: a file written in host 1's /tmp is not in host 2's
        h1.run(["sh", "-c", "echo one > /tmp/kvtier-marker"])
        assert h2.run(["cat", "/tmp/kvtier-marker"], check=False).returncode != 0
        assert (tmp_path / "host1" / "tmp" / "kvtier-marker").read_text() == "one\n"
        assert not Path("/tmp/kvtier-marker").exists()
        sleeper = h2.popen(["sleep", "600"])
        tag, veth = net.tag, net.root_veth
    assert sleeper.wait(10) is not None  # stopped by PID at `down`
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert tag not in names
    assert not Path(f"/sys/class/net/{veth}").exists()


def test_down_from_recorded_state(tmp_path) -> None:
    net = HostNetwork.up(1)
    try:
        again = HostNetwork.from_state(net.tag)
        assert again.describe() == net.describe()
    finally:
        HostNetwork.from_state(net.tag).down()
    assert net.hosts[0].netns not in subprocess.run(["ip", "netns", "list"],
                                                    capture_output=True, text=True).stdout
