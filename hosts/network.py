"""Several "hosts" on this machine: network namespaces on a private bridge (Linux, root, `ip`).

    with HostNetwork.up(3) as net:              # hosts h1..h3, 198.18.K.1..3, a bridge
        net.hosts[0].address                     # '198.18.K.1'
        net.hosts[1].run(["python3", "-c", "..."])   # runs inside host 2
    # every process in the hosts is stopped by PID, the namespaces and veths are deleted

Layout (K: a free /24 in 198.18.0.0/15, the benchmarking range; nothing else is routed):
  * namespace `<tag>-br` holds a Linux bridge; each host namespace `<tag>-hN` has one veth
    into it with address 198.18.K.N/24 and its own loopback (up);
  * the root namespace gets one veth into the bridge, 198.18.K.254/24, for the driver side
    (load generators, the TCP ceiling): its only change is a route to 198.18.K.0/24.
A host's processes may get private bind mounts (a path that shows a different directory on
each host: a node-local /tmp, a home directory of its own); they live in the mount namespace
`ip netns exec` gives each launch, so every launch in a host applies the host's mounts.
State (the tag and addresses) is written to /run/kvtier-hosts/<tag>.json for `down`.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, Mapping, NamedTuple, Sequence

from kvtier.errors import KvtierError

SUBNETS = ipaddress.ip_network("198.18.0.0/15")  # RFC 2544 benchmarking range
ROOT_HOST_BYTE = 254  # the root namespace's address in each /24
STATE_DIR = Path("/run/kvtier-hosts")
TAG_PREFIX = "kvh"
STOP_TIMEOUT_S = 5.0


class HostsUnavailable(KvtierError, RuntimeError):
    """This machine cannot run the host harness (not root, no `ip`, no namespaces)."""


def why_unavailable() -> str | None:
    """None when the harness can run here, else the reason (tests skip with it)."""
    if os.geteuid() != 0:
        return "the host harness needs root (network namespaces, veths, bind mounts)"
    if shutil.which("ip") is None:
        return "the host harness needs the `ip` command (Debian: apt-get install iproute2)"
    probe = f"{TAG_PREFIX}probe{os.getpid() % 10000}"
    try:
        _ip("netns", "add", probe)
    except HostsUnavailable as exc:
        return f"cannot create a network namespace here: {exc}"
    _ip("netns", "del", probe, check=False)
    return None


def _ip(*args: str, check: bool = True) -> str:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise HostsUnavailable(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


class Host(NamedTuple):
    """One namespace-host: its name, netns, address and private mounts (target -> source)."""

    index: int  # 1-based
    netns: str
    address: str
    mounts: Mapping[str, str]

    @property
    def name(self) -> str:
        return f"host{self.index}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` wrapped to run inside this host (its network and private mounts)."""
        inner = list(argv)
        if self.mounts:  # recursive: a private dir carries the paths kept inside it
            binds = " && ".join(f"mount --rbind {shlex.quote(src)} {shlex.quote(dst)}"
                                for dst, src in self.mounts.items())
            inner = ["sh", "-c", f"{binds} && exec \"$@\"", "sh", *inner]
        return ["ip", "netns", "exec", self.netns, *inner]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              unset: Sequence[str] = (), **kwargs) -> subprocess.Popen:
        """Start `argv` inside the host (in a session of its own) with this environment,
        `unset` removed and `env` added; it is stopped with the host's other processes at
        teardown."""
        return subprocess.Popen(self.command(argv), env=_environ(env, unset),
                                start_new_session=True, **kwargs)

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout_s: float = 120.0, check: bool = True, unset: Sequence[str] = ()
            ) -> subprocess.CompletedProcess:
        """Run `argv` inside the host to completion (environment as for `popen`); its
        output, text."""
        proc = subprocess.run(self.command(argv), env=_environ(env, unset), capture_output=True,
                              text=True, timeout=timeout_s)
        if check and proc.returncode != 0:
            raise HostsUnavailable(f"{shlex.join(argv)} in {self.name} exited {proc.returncode}:"
                                   f"\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        return proc

    def pids(self) -> list[int]:
        """Every process in this host's network namespace, whoever started it."""
        return [int(p) for p in _ip("netns", "pids", self.netns, check=False).split()]

    def set_link(self, up: bool) -> None:
        """Cut (`up=False`) or restore this host's link to the bridge."""
        _ip("-n", self.netns, "link", "set", _veth(self.netns), "up" if up else "down")


def keep_paths() -> list[str]:
    """What every host must see as this machine has it, whatever private directory covers
    it: this checkout (the harness runs its modules and scripts inside the hosts) and this
    Python (the venv and the installation its interpreter links to)."""
    checkout = Path(__file__).resolve().parent.parent  # hosts/ sits at the checkout's top
    return sorted({str(checkout), sys.prefix, sys.base_prefix,
                   str(Path(sys.executable).resolve().parent.parent)})


def private_dirs(base: str | os.PathLike, n: int, target: str, name: str, mode: int,
                 keep: Sequence[str] | None = None) -> list[dict[str, str]]:
    """Mounts giving each of `n` hosts its own `target` directory (`base`/hostK/`name`), as
    separate machines have. Paths of `keep` (default: keep_paths()) under `target` stay the
    machine's own: each is bound onto the same place inside the private directory first,
    and the private directory goes over `target` with its submounts."""
    keep = keep_paths() if keep is None else keep
    inside = sorted({p for p in keep if Path(p).is_relative_to(target) and Path(p) != Path(target)})
    mounts = []
    for i in range(n):
        d = Path(base) / f"host{i + 1}" / name
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(mode)
        m = {}
        for path in inside:
            view = d / Path(path).relative_to(target)
            view.mkdir(parents=True, exist_ok=True)
            m[str(view)] = path
        m[target] = str(d)
        mounts.append(m)
    return mounts


def merge_mounts(*per_host: Sequence[Mapping[str, str]]) -> list[dict[str, str]]:
    """One mounts dict per host from several lists, in the order given."""
    return [{k: v for m in mounts for k, v in m.items()} for mounts in zip(*per_host)]


def _environ(env: Mapping[str, str] | None, unset: Sequence[str]) -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if k not in unset}
    out.update(env or {})
    return out


def _veth(netns: str) -> str:
    return f"{netns}-e"[-15:]  # interface names are at most 15 characters


class HostNetwork:
    """N hosts on one bridge; `down()` (or leaving the `with`) stops and deletes everything."""

    def __init__(self, tag: str, subnet: ipaddress.IPv4Network, hosts: list[Host]) -> None:
        self.tag, self.subnet, self.hosts = tag, subnet, hosts

    @property
    def bridge_netns(self) -> str:
        return f"{self.tag}-br"

    @property
    def root_veth(self) -> str:
        return f"{self.tag}-r"

    @property
    def root_address(self) -> str:
        return str(self.subnet.network_address + ROOT_HOST_BYTE)

    @classmethod
    def up(cls, n: int, mounts: Sequence[Mapping[str, str]] | None = None) -> "HostNetwork":
        """Create `n` hosts (`mounts[i]`: host i+1's private bind mounts, target -> source)."""
        if not 1 <= n <= 200:
            raise HostsUnavailable(f"the harness makes 1..200 hosts, not {n}")
        why = why_unavailable()
        if why:
            raise HostsUnavailable(why)
        tag, subnet = _claim_subnet()
        hosts = [Host(i + 1, f"{tag}-h{i + 1}", str(subnet.network_address + i + 1),
                      dict((mounts or [{}] * n)[i] if mounts else {})) for i in range(n)]
        net = cls(tag, subnet, hosts)
        try:
            net._create()
        except BaseException:
            net.down()
            raise
        return net

    def _create(self) -> None:
        self._save()
        br = self.bridge_netns
        _ip("netns", "add", br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for h in self.hosts:
            _ip("netns", "add", h.netns)
            self._wire(h.netns, f"{h.netns}-b"[-15:], _veth(h.netns), h.address)
            _ip("-n", h.netns, "link", "set", "lo", "up")
        self._wire(None, f"{self.tag}-rb", self.root_veth, self.root_address)

    def _wire(self, netns: str | None, bridge_end: str, host_end: str, address: str) -> None:
        """A veth: `bridge_end` into the bridge, `host_end` in `netns` (None: the root)."""
        br = self.bridge_netns
        _ip("link", "add", host_end, "type", "veth", "peer", "name", bridge_end)
        _ip("link", "set", bridge_end, "netns", br)
        _ip("-n", br, "link", "set", bridge_end, "master", "br0")
        _ip("-n", br, "link", "set", bridge_end, "up")
        where: list[str] = []
        if netns is not None:
            _ip("link", "set", host_end, "netns", netns)
            where = ["-n", netns]
        _ip(*where, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", host_end)
        _ip(*where, "link", "set", host_end, "up")

    def _save(self) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        (STATE_DIR / f"{self.tag}.json").write_text(json.dumps(self.describe()))

    def describe(self) -> dict:
        return {"tag": self.tag, "subnet": str(self.subnet), "root_address": self.root_address,
                "hosts": [{"name": h.name, "netns": h.netns, "address": h.address}
                          for h in self.hosts]}

    def bytes_sent(self) -> dict[str, int]:
        """Bytes each host has sent into the bridge so far (its port's receive counter in the
        bridge namespace): traffic between hosts, and from hosts to the root's veth."""
        links = json.loads(_ip("-n", self.bridge_netns, "-j", "-s", "link", "show"))
        rx = {link["ifname"]: link.get("stats64", {}).get("rx", {}).get("bytes", 0)
              for link in links}
        return {h.name: int(rx.get(f"{h.netns}-b"[-15:], 0)) for h in self.hosts}

    def stop_processes(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """TERM every process in the hosts, then KILL what is left after `timeout_s`."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for h in self.hosts:
                for pid in h.pids():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, sig)
            deadline = time.monotonic() + timeout_s
            while any(h.pids() for h in self.hosts) and time.monotonic() < deadline:
                time.sleep(0.1)

    def down(self) -> None:
        """Stop every process in the hosts and delete the namespaces and veths."""
        self.stop_processes()
        _ip("link", "del", self.root_veth, check=False)
        for h in self.hosts:
            _ip("netns", "del", h.netns, check=False)
        _ip("netns", "del", self.bridge_netns, check=False)
        deadline = time.monotonic() + 10  # namespaces are freed asynchronously
        while _root_veth_exists(self.root_veth) and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(FileNotFoundError):
            (STATE_DIR / f"{self.tag}.json").unlink()

    def __enter__(self) -> "HostNetwork":
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    @classmethod
    def from_state(cls, tag: str) -> "HostNetwork":
        """The network `up` recorded under `tag` (for `down` from another process)."""
        data = json.loads((STATE_DIR / f"{tag}.json").read_text())
        hosts = [Host(i + 1, h["netns"], h["address"], {}) for i, h in enumerate(data["hosts"])]
        return cls(data["tag"], ipaddress.ip_network(data["subnet"]), hosts)


def _root_veth_exists(name: str) -> bool:
    return Path(f"/sys/class/net/{name}").exists()


def _claim_subnet() -> tuple[str, ipaddress.IPv4Network]:
    """A tag and /24 no other live harness uses (claimed by creating its state file)."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    taken = set(_ip("netns", "list", check=False).split())
    for i, subnet in enumerate(SUBNETS.subnets(new_prefix=24)):
        tag = f"{TAG_PREFIX}{i}"
        if f"{tag}-br" in taken or _root_veth_exists(f"{tag}-r"):
            continue
        try:
            fd = os.open(STATE_DIR / f"{tag}.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        return tag, subnet
    raise HostsUnavailable("no free /24 left in 198.18.0.0/15: run `scripts/hosts.sh down`")


def live_tags() -> list[str]:
    """Tags of harness networks recorded on this machine."""
    return sorted(p.stem for p in STATE_DIR.glob(f"{TAG_PREFIX}*.json")) \
        if STATE_DIR.is_dir() else []


@contextlib.contextmanager
def host_network(n: int, mounts: Sequence[Mapping[str, str]] | None = None
                 ) -> Iterator[HostNetwork]:
    net = HostNetwork.up(n, mounts)
    try:
        yield net
    finally:
        net.down()
