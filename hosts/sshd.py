"""An sshd in each of the harness's hosts, as on separate machines: it listens on its host's
address only, takes root's key only, and its sessions see a home directory of their own.

    homes = private_homes(workdir, 3)            # {"/root": workdir/host1/home}, ...
    with host_network(3, homes) as net, SshHosts(net) as ssh:
        ssh.start()
        ssh.run(net.hosts[1], "cat ~/.ssh/authorized_keys")      # as root@198.18.K.2

Each sshd runs `sshd -D -e -f <its config>` inside its host (Host.popen): the host's private
bind mounts are made for that launch, so sshd and every session it forks (its children, in
the same mount namespace) see the host's own ~ (and /tmp, if the host has one). Host keys,
configs, pid files and the client key pair live in /run/kvtier-hosts/<tag>-ssh (a path no
host mount hides; deleted at stop); /root/.ssh of the machine is never read or written.
Processes stop with the network (by PID, per host).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Sequence

from kvtier.hosts.network import STATE_DIR, Host, HostNetwork, HostsUnavailable, private_dirs
from kvtier.hosts.ray_nodes import wait_port

SSHD = "/usr/sbin/sshd"
SSH_PORT = 22
SSH_USER, SSH_HOME = "root", "/root"
PRIVSEP_DIR = Path("/run/sshd")  # Debian's sshd refuses to start without it
WAIT_SSHD_S = 20.0
CONFIG = """\
ListenAddress {address}:{port}
HostKey {host_key}
PidFile {pid_file}
PermitRootLogin prohibit-password
PubkeyAuthentication yes
AuthorizedKeysFile .ssh/authorized_keys
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes yes
PrintMotd no
X11Forwarding no
AllowTcpForwarding yes
MaxSessions 64
MaxStartups 64:30:128
Subsystem sftp internal-sftp
"""
# What ssh needs to talk to hosts whose keys are new on every run (nothing is remembered).
CLIENT_OPTIONS = ("-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                  "-o", "BatchMode=yes", "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10")


def private_homes(base: str | os.PathLike, n: int, home: str = SSH_HOME,
                  keep: Sequence[str] | None = None) -> list[dict[str, str]]:
    """Mounts giving each of `n` hosts its own `home` (under `base`), owner-only as sshd's
    StrictModes wants it. `keep`: paths under `home` that stay the machine's own inside every
    host (default: this checkout and this Python when they live there, e.g. pyenv's, which a
    venv's python links to; separate machines each have their own)."""
    return private_dirs(base, n, home, "home", 0o700, keep)


def ssh_keygen(path: Path, comment: str) -> Path:
    """A new ed25519 key pair at `path` (and `path`.pub); the private key's path."""
    path.unlink(missing_ok=True)
    path.with_suffix(".pub").unlink(missing_ok=True)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                    "-f", str(path)], check=True, capture_output=True)
    return path


class SshHosts:
    """One sshd per host of `net` (each host must have a private SSH_HOME mount)."""

    def __init__(self, net: HostNetwork) -> None:
        self.net = net
        self.workdir = STATE_DIR / f"{net.tag}-ssh"  # sshd reads it inside the hosts
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.key_path = ssh_keygen(self.workdir / "id_ed25519", "kvtier-hosts")
        self.procs: dict[str, subprocess.Popen] = {}

    def home(self, host: Host) -> Path:
        """The directory that is SSH_HOME inside `host`."""
        if SSH_HOME not in host.mounts:
            raise HostsUnavailable(f"{host.name} has no private {SSH_HOME}: "
                                   f"make the network with private_homes()")
        return Path(host.mounts[SSH_HOME])

    def start(self, wait_s: float = WAIT_SSHD_S) -> None:
        """Start every host's sshd and wait until each accepts connections."""
        PRIVSEP_DIR.mkdir(mode=0o755, exist_ok=True)
        for host in self.net.hosts:
            self._authorize(host)
            config = self._write_config(host)
            log = open(self.workdir / f"{host.name}-sshd.log", "ab")
            # sessions get the environment sshd builds (PATH, HOME...), never sshd's own
            self.procs[host.name] = host.popen([SSHD, "-D", "-e", "-f", str(config)],
                                               stdout=log, stderr=log)
            log.close()
        for host in self.net.hosts:
            if not wait_port(host.address, SSH_PORT, wait_s):
                raise HostsUnavailable(f"sshd in {host.name} did not accept on "
                                       f"{host.address}:{SSH_PORT} within {wait_s:.0f} s: "
                                       f"{self.log(host)[-2000:]}")

    def _authorize(self, host: Host) -> None:
        ssh_dir = self.home(host) / ".ssh"
        ssh_dir.mkdir(mode=0o700, exist_ok=True)
        keys = ssh_dir / "authorized_keys"
        keys.write_text(self.key_path.with_suffix(".pub").read_text())
        keys.chmod(0o600)

    def _write_config(self, host: Host) -> Path:
        d = self.workdir / host.name
        d.mkdir(exist_ok=True)
        host_key = ssh_keygen(d / "ssh_host_ed25519_key", f"kvtier-{host.name}")
        config = d / "sshd_config"
        config.write_text(CONFIG.format(address=host.address, port=SSH_PORT, host_key=host_key,
                                        pid_file=d / "sshd.pid"))
        return config

    def log(self, host: Host) -> str:
        path = self.workdir / f"{host.name}-sshd.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def ssh_argv(self, host: Host, command: str) -> list[str]:
        """ssh from the root namespace to `host` as SSH_USER, running `command`."""
        return ["ssh", "-i", str(self.key_path), *CLIENT_OPTIONS,
                f"{SSH_USER}@{host.address}", command]

    def run(self, host: Host, command: str, timeout_s: float = 60.0,
            check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(self.ssh_argv(host, command), capture_output=True, text=True,
                              timeout=timeout_s, env=_plain_env())
        if check and proc.returncode != 0:
            raise HostsUnavailable(f"ssh {host.name} {command!r} exited {proc.returncode}: "
                                   f"{proc.stderr[-2000:]}")
        return proc

    def stop(self) -> None:
        """Stop the sshds (and what their sessions left) with every process in the hosts."""
        self.net.stop_processes()
        self.procs.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "SshHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _plain_env() -> dict[str, str]:
    """The environment without Ray's variables (none of them belongs on another host)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
