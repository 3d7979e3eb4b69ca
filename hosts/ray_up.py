"""The project's `cluster.yaml` brought up with the real `ray up` over the harness's hosts.

    workdir = make_workdir()                     # under /var/tmp: every host sees it
    with host_network(3, cluster_mounts(workdir, 3)) as net, SshHosts(net) as ssh:
        ssh.start()
        cluster = RayUp(net, ssh, workdir)
        cluster.up()                             # `ray up -y --no-config-cache <copy>`
        cluster.wait_nodes()                     # a probe driver inside host 1
    # teardown: every process in the hosts stopped by PID (never `ray down` / `ray stop`)

Each host has a private home (/root, where `ray up` puts ~/kvtier, ~/.ray/auth_token and the
bootstrap config) and a private /tmp (Ray's session files, the local provider's state), as
separate machines would. The copy of cluster.yaml differs from the project's only where this
machine differs from a real cluster: provider.head_ip / worker_ips are the hosts' addresses,
auth is root with the harness's key, the token file is this cluster's fresh one, and the hosts
reach no package registry, so the setup commands link ~/kvtier/.venv to the venv already
built here instead of running bootstrap.sh. The start commands and their resources are the
project's own. `ray up` runs in the root namespace with its own HOME and TMPDIR (the real
root's ~/.ray and /tmp/ray are not touched) and an environment scrubbed of what pins Ray to
loopback or turns auth off.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from kvtier.hosts.network import HostNetwork, HostsUnavailable, merge_mounts
from kvtier.hosts.ray_nodes import NODES_PROBE, SCRUBBED, RayHosts, private_tmp, ray_binary
from kvtier.hosts.sshd import SSH_USER, SshHosts, private_homes

REPO = Path(__file__).resolve().parent.parent
CLUSTER_YAML = REPO / "cluster.yaml"
WORK_BASE = "/var/tmp"  # not /tmp: each host's /tmp is its own
UP_TIMEOUT_S = 300.0
WAIT_NODES_S = 300.0  # the head's autoscaler sets the workers up after `ray up` returns; a
# worker whose start times out (a loaded machine) is set up again
TOKEN_TARGET = "~/.ray/auth_token"  # where Ray looks for the token by default
REPO_TARGET = "~/kvtier"


def make_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvtier-rayup-", dir=WORK_BASE))


def cluster_mounts(workdir: Path, n: int) -> list[dict[str, str]]:
    """Each host's private home and /tmp (under `workdir`)."""
    return merge_mounts(private_homes(workdir, n), private_tmp(workdir, n))


def local_copy(project: dict[str, Any], net: HostNetwork, key_path: Path, token_path: Path,
               venv: Path) -> dict[str, Any]:
    """The project's cluster config for the harness's hosts (see the module's docstring)."""
    config = yaml.safe_load(yaml.safe_dump(project))  # a deep copy
    config["provider"]["head_ip"] = net.hosts[0].address
    config["provider"]["worker_ips"] = [h.address for h in net.hosts[1:]]
    config["auth"] = {"ssh_user": SSH_USER, "ssh_private_key": str(key_path)}
    mounts = config.get("file_mounts") or {}
    repo_source = {target for target, source in mounts.items() if source == "."}
    if repo_source != {REPO_TARGET}:
        raise HostsUnavailable(f"cluster.yaml no longer mounts the repository ('.') at "
                               f"{REPO_TARGET}: {mounts}")
    mounts[REPO_TARGET] = str(REPO)  # `.` is the directory `ray up` runs in
    mounts[TOKEN_TARGET] = str(token_path)
    config["file_mounts"] = mounts
    # no registry here: the venv this machine built, instead of apt-get and bootstrap.sh
    config["setup_commands"] = [
        f"ln -sfn {venv} {REPO_TARGET}/.venv && {REPO_TARGET}/.venv/bin/python -c "
        f"'import kvtier, ray'"]
    return config


class RayUp:
    """`ray up` of a copy of cluster.yaml over `net`'s hosts; drivers, probes and the token
    come from RayHosts (drivers run inside host 1 with RAY_ADDRESS and the token)."""

    def __init__(self, net: HostNetwork, ssh: SshHosts, workdir: Path,
                 project_yaml: Path = CLUSTER_YAML) -> None:
        self.net, self.ssh, self.workdir = net, ssh, Path(workdir)
        self.ray = RayHosts(net, self.workdir / "ray")  # its token becomes the cluster's
        project = yaml.safe_load(project_yaml.read_text())
        self.config = local_copy(project, net, ssh.key_path, self.ray.token_path,
                                 Path(sys.executable).parent.parent)
        self.config_path = self.workdir / "cluster.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.log_path = self.workdir / "ray-up.log"

    def client_env(self) -> dict[str, str]:
        """`ray up`'s environment: its own HOME and TMPDIR (the local provider keeps its state
        in $TMPDIR/ray), nothing that pins Ray to loopback or turns auth off."""
        home, tmp = self.workdir / "client-home", self.workdir / "client-tmp"
        home.mkdir(exist_ok=True)
        tmp.mkdir(exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in SCRUBBED}
        env.update(HOME=str(home), TMPDIR=str(tmp))
        return env

    def up(self, timeout_s: float = UP_TIMEOUT_S) -> float:
        """Run `ray up` (it sets up and starts the head; the head's autoscaler then sets up
        and starts the workers); its seconds. Its output goes to `log_path`."""
        started = time.monotonic()
        argv = [ray_binary(), "up", "-y", "--no-config-cache", "--log-color", "false",
                str(self.config_path)]
        with open(self.log_path, "ab") as log:
            try:
                proc = subprocess.run(argv, env=self.client_env(), cwd=REPO, stdout=log,
                                      stderr=subprocess.STDOUT, timeout=timeout_s,
                                      start_new_session=True)
            except subprocess.TimeoutExpired as exc:
                raise HostsUnavailable(f"`ray up` ran past {timeout_s:.0f} s: "
                                       f"{self.log_tail()}") from exc
        if proc.returncode != 0:
            raise HostsUnavailable(f"`ray up` exited {proc.returncode}: {self.log_tail()}")
        return time.monotonic() - started

    def wait_nodes(self, wait_s: float = WAIT_NODES_S) -> list[dict]:
        """Every host's node alive (a probe driver inside host 1); the nodes (ip, resources).
        A shortfall raises with the autoscaler's log and each host's raylet output."""
        expect = len(self.net.hosts)
        out = self.ray.driver(["-c", NODES_PROBE, str(expect), str(wait_s)], check=False,
                              timeout_s=wait_s + 60)
        nodes = _last_json_line(out.stdout)
        if nodes is None or len(nodes) < expect:
            raise HostsUnavailable(
                f"{len(nodes or [])} of {expect} nodes alive after {wait_s:.0f} s: {nodes}\n"
                f"probe: {out.stdout[-2000:]}{out.stderr[-2000:]}\n"
                f"autoscaler: {self.autoscaler_log()}\n{self.raylet_logs()}")
        return nodes

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def autoscaler_log(self, chars: int = 4000) -> str:
        """The head's autoscaler log (it sets the workers up), from host 1's private /tmp."""
        return self._session_logs(self.net.hosts[0], "monitor.*", chars)

    def raylet_logs(self, chars: int = 2000) -> str:
        return "\n".join(f"{h.name} raylet: {self._session_logs(h, 'raylet.out', chars)}"
                         for h in self.net.hosts)

    def _session_logs(self, host, pattern: str, chars: int) -> str:
        """The tails of `pattern` in `host`'s latest Ray session (its private /tmp: the
        session_latest link is absolute, so it is resolved by name here)."""
        sessions = sorted(self.workdir.glob(f"{host.name}/tmp/ray/session_2*"))  # by time
        logs = sorted(sessions[-1].glob(f"logs/{pattern}")) if sessions else []
        return "".join(p.read_text(errors="replace")[-chars:] for p in logs)


def ray_pids(pids: list[int]) -> list[int]:
    """Those of `pids` that run Ray (raylet, GCS, workers, agents)."""
    out = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"ray" in cmdline:
            out.append(pid)
    return out


def environ(pid: int) -> dict[str, str]:
    """A process's environment as it started (/proc/PID/environ)."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def _last_json_line(text: str) -> list | None:
    """The last line of `text` that is a JSON list (Ray may print after the probe's line)."""
    for line in reversed(text.strip().splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, list):
            return value
    return None
