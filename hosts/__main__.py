"""`python -m kvtier.hosts up N | down [TAG] | list`: the host harness for people
(`scripts/hosts.sh` calls it). `up` prints the hosts and how to run a command in one."""
from __future__ import annotations

import argparse
import json
import sys

from kvtier.hosts.network import HostNetwork, HostsUnavailable, live_tags


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.hosts", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create N hosts (network namespaces on a private bridge)")
    up.add_argument("n", type=int)
    down = sub.add_parser("down", help="stop everything in the hosts and delete them")
    down.add_argument("tag", nargs="?", help="one network (default: every one recorded)")
    sub.add_parser("list", help="the networks recorded on this machine")
    ns = p.parse_args(argv)
    try:
        if ns.cmd == "up":
            net = HostNetwork.up(ns.n)
            print(json.dumps(net.describe(), indent=1))
            print(f"run a command in host 1: ip netns exec {net.hosts[0].netns} CMD; "
                  f"remove them: scripts/hosts.sh down {net.tag}", file=sys.stderr)
        elif ns.cmd == "down":
            for tag in [ns.tag] if ns.tag else live_tags():
                HostNetwork.from_state(tag).down()
                print(f"{tag}: down")
        else:
            for tag in live_tags():
                print(json.dumps(HostNetwork.from_state(tag).describe()))
    except (HostsUnavailable, FileNotFoundError) as exc:
        print(f"hosts: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
