"""Who listens where: TCP listeners of a process tree, read from /proc (Linux, no psutil).

kvtier promises that everything it starts binds to 127.0.0.1 unless configured otherwise; the
tests (and operators) check that promise with these two functions.
"""
from __future__ import annotations

import ipaddress
import os
from typing import Iterable, NamedTuple


class Listener(NamedTuple):
    host: str  # IPv4-mapped IPv6 addresses are shown as IPv4
    port: int
    pid: int


def descendants(pid: int) -> set[int]:
    """Pids of every process below `pid`."""
    parent = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    found, todo = set(), [pid]
    while todo:
        at = todo.pop()
        kids = [p for p, pp in parent.items() if pp == at and p not in found]
        found.update(kids)
        todo += kids
    return found


def _host(hexaddr: str) -> str:
    raw = bytes.fromhex(hexaddr)  # little-endian 32-bit words
    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    return str(getattr(ip, "ipv4_mapped", None) or ip)


def _tables(pids: Iterable[int]) -> dict[str, tuple[str, int]]:
    """inode -> (host, port) of every TCP socket in LISTEN state in the network namespaces
    of `pids` (each process reads its own namespace's table under /proc/PID/net)."""
    seen_ns, socks = set(), {}
    for pid in pids:
        try:
            ns = os.stat(f"/proc/{pid}/ns/net").st_ino
        except OSError:
            continue
        if ns in seen_ns:
            continue
        seen_ns.add(ns)
        for table in ("tcp", "tcp6"):
            try:
                with open(f"/proc/{pid}/net/{table}") as f:
                    lines = f.readlines()[1:]
            except OSError:
                continue
            for line in lines:
                cols = line.split()
                if cols[3] == "0A":  # LISTEN
                    addr, port = cols[1].split(":")
                    socks[cols[9]] = (_host(addr), int(port, 16))
    return socks


def listening(pids: Iterable[int]) -> list[Listener]:
    """Every TCP socket in LISTEN state held by `pids` (processes that exited are skipped),
    in whatever network namespace each process runs."""
    pids = list(pids)
    socks = _tables(pids)
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if link.startswith("socket:[") and link[8:-1] in socks:
                out.append(Listener(*socks[link[8:-1]], pid))
    return out
