"""A Ray cluster across the harness's hosts, token auth on: the head in host 1, a worker node
in each other host, drivers run inside host 1.

    with host_network(3, private_tmp(...)) as net, RayHosts(net, workdir) as ray_hosts:
        ray_hosts.start(head_resources={"kvtier_head": 1},
                        worker_resources={"kvtier_instance": 4})
        out = ray_hosts.driver(["-m", "kvtier", "demo", ...])   # runs in host 1

Processes are started with the `ray` command of this interpreter's environment (never the
Python API: the driver is another process, inside host 1). Every node is told its host's
address (`--node-ip-address`); the token is a fresh random one, written to a file that every
node and driver reads through RAY_AUTH_TOKEN_PATH, and RAY_AUTH_MODE=token is explicit.
The environment is scrubbed of what pins Ray to loopback or turns auth off.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

from kvtier.hosts.network import HostNetwork, HostsUnavailable, private_dirs

GCS_PORT = 6379
MiB = 1 << 20
OBJECT_STORE_BYTES = 96 * MiB
# Variables that would pin Ray to loopback or switch token auth off in a child process.
SCRUBBED = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN",
            "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS")
WAIT_NODES_S = 90.0
NODES_PROBE = """
import json, sys, time, ray
ray.init(log_to_driver=False)
deadline = time.monotonic() + float(sys.argv[2])
while True:
    alive = [n for n in ray.nodes() if n["Alive"]]
    if len(alive) >= int(sys.argv[1]) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps([{"ip": n["NodeManagerAddress"], "resources": n["Resources"]} for n in alive]))
"""


def ray_binary() -> str:
    return str(Path(sys.executable).parent / "ray")


class RayHosts:
    """The Ray processes of one cluster over `net`'s hosts; they stop with the network (by
    PID, per host) or with `stop()`."""

    def __init__(self, net: HostNetwork, workdir: str | os.PathLike) -> None:
        self.net = net
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.token_path = self.workdir / "ray_auth_token"
        self.token_path.write_text(secrets.token_hex(32))
        self.token_path.chmod(0o600)
        self.started = False
        self._worker: tuple[int, dict[str, float]] = (2, {})  # cpus, resources

    @property
    def head(self):
        return self.net.hosts[0]

    @property
    def address(self) -> str:
        return f"{self.head.address}:{GCS_PORT}"

    def env(self, with_token: bool = True, **extra: str) -> dict[str, str]:
        """The environment of a Ray process in a host: auth on with this cluster's token
        (`with_token=False`: auth on, no token, for refusal tests). Run it with
        `unset=SCRUBBED`: Host merges it into this process's environment."""
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
        env["RAY_AUTH_MODE"] = "token"
        if with_token:
            env["RAY_AUTH_TOKEN_PATH"] = str(self.token_path)
        env.update(extra)
        return env

    def start(self, head_resources: Mapping[str, float] | None = None,
              worker_resources: Mapping[str, float] | None = None, *, head_cpus: int = 1,
              worker_cpus: int = 2, wait_s: float = WAIT_NODES_S,
              head_env: Mapping[str, str] | None = None) -> list[dict]:
        """Start the head and the workers and wait until all are alive; the nodes as Ray
        lists them (ip, resources). `head_env`: Ray settings for the head (its GCS), e.g.
        RAY_health_check_period_ms."""
        self._ray_start(self.head, ["--head", f"--port={GCS_PORT}"], head_cpus, head_resources,
                        head_env)
        self.started = True
        self._worker = (worker_cpus, dict(worker_resources or {}))
        for host in self.net.hosts[1:]:
            self.start_worker(host)
        nodes = self.nodes(expect=len(self.net.hosts), wait_s=wait_s)
        if len(nodes) < len(self.net.hosts):
            raise HostsUnavailable(f"only {len(nodes)} of {len(self.net.hosts)} Ray nodes came "
                                   f"up within {wait_s:.0f} s: {nodes}")
        return nodes

    def _ray_start(self, host, args: Sequence[str], cpus: int,
                   resources: Mapping[str, float] | None,
                   env: Mapping[str, str] | None = None) -> None:
        argv = [ray_binary(), "start", *args, f"--node-ip-address={host.address}",
                f"--num-cpus={cpus}", f"--object-store-memory={OBJECT_STORE_BYTES}",
                "--disable-usage-stats", f"--resources={json.dumps(dict(resources or {}))}"]
        if "--head" in args:
            argv.append("--include-dashboard=false")
        host.run(argv, env=self.env(**(env or {})), timeout_s=120, unset=SCRUBBED)

    def start_worker(self, host) -> None:
        """(Re)start one worker node in `host` (after its raylet was killed) with the CPUs
        and resources `start` gave the workers."""
        cpus, resources = self._worker
        self._ray_start(host, [f"--address={self.address}"], cpus, resources)

    def driver(self, argv: Sequence[str], *, timeout_s: float = 600.0, check: bool = True,
               env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess:
        """Run `python ARGV` as a driver inside host 1 (RAY_ADDRESS set); its output."""
        return self.head.run([sys.executable, *argv],
                             env=self.env(RAY_ADDRESS=self.address, **(env or {})),
                             timeout_s=timeout_s, check=check, unset=SCRUBBED)

    def driver_popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
                     **kwargs) -> subprocess.Popen:
        return self.head.popen([sys.executable, *argv],
                               env=self.env(RAY_ADDRESS=self.address, **(env or {})),
                               unset=SCRUBBED, **kwargs)

    def nodes(self, expect: int = 0, wait_s: float = 0.0) -> list[dict]:
        """Alive nodes (waiting up to `wait_s` for `expect` of them)."""
        out = self.driver(["-c", NODES_PROBE, str(expect), str(wait_s)],
                          timeout_s=wait_s + 60)
        return json.loads(out.stdout.strip().splitlines()[-1])

    def kill_raylet(self, host) -> None:
        """SIGKILL every Ray process of `host` (its raylet, workers and agents)."""
        for pid in host.pids():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        """Stop every process in the hosts (Ray's and anything else): by PID, per host."""
        self.net.stop_processes()
        self.started = False

    def __enter__(self) -> "RayHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def private_tmp(base: str | os.PathLike, n: int) -> list[dict[str, str]]:
    """Mounts giving each of `n` hosts a /tmp of its own (under `base`): a node-local temp
    directory, as on separate machines (Ray's session files included); this checkout and
    its Python stay visible where they are."""
    return private_dirs(base, n, "/tmp", "tmp", 0o1777)


def wait_port(host_address: str, port: int, timeout_s: float) -> bool:
    """True once `host_address:port` accepts a connection (from the root namespace)."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host_address, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.2)
    return False
