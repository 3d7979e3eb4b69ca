"""`ray up` for real over the host harness: an sshd in each host (its address only, key-only
root, a home of its own per host), the project's cluster.yaml brought up by the real `ray up`
(local provider, head_ip / worker_ips from the harness, the project's start commands and
resources), then `kvtier serve --address auto` on that cluster, started over ssh in host 1,
and one chat completion whose prompt another host's instance computed (an L3 hit).

The cluster tests are marked `ray_up` (deselected by default; `make test-ray-up`): `ray up`
and the worker setup alone take about a minute on two cores. Teardown stops every process in
the hosts by PID; never `ray down` / `ray stop` (they stop every Ray process on a machine).
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvtier.hosts.network import HostNetwork, host_network
from kvtier.hosts.ray_up import RayUp, cluster_mounts, environ, make_workdir, ray_pids
from kvtier.hosts.sshd import SSH_HOME, SSH_PORT, SSHD, SshHosts, private_homes
from kvtier.netcheck import listening

HOSTS = 3
SERVE_PORT = 8000
ADMIN_KEY = "ray-up-admin-" + secrets.token_hex(8)
PROMPT = ("Record {i}: the shipment of {i} crates left the northern depot on schedule and the "
          "ledger was signed by the duty clerk. ")
CLUSTER = pytest.mark.ray_up
pytestmark = pytest.mark.skipif(not (Path(SSHD).exists() and shutil.which("rsync")),
                                reason="needs sshd and rsync (apt-get install openssh-server "
                                       "rsync; scripts/bootstrap.sh does it as root)")


def test_sshd_listens_on_its_host_only_and_sessions_have_a_home_per_host(tmp_path) -> None:
    with host_network(2, private_homes(tmp_path, 2)) as net, SshHosts(net) as ssh:
        ssh.start()
        for host in net.hosts:
            (ssh.home(host) / "kvtier-host").write_text(host.name)
            found = {(l.host, l.port) for l in listening(host.pids())}
            assert found == {(host.address, SSH_PORT)}, (host.name, found)
            # a session is sshd's child: it sees the home mounted for sshd's launch
            out = ssh.run(host, "echo $HOME; cat ~/kvtier-host; echo; "
                                "ip -o -4 addr show scope global")
            home, name, addr = out.stdout.strip().splitlines()
            assert (home, name) == (SSH_HOME, host.name)
            assert f" {host.address}/" in addr
        assert not Path(SSH_HOME, "kvtier-host").exists()  # the machine's own home untouched
        refused = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "PubkeyAuthentication=no",
                                  "-o", "StrictHostKeyChecking=no", "-o",
                                  "UserKnownHostsFile=/dev/null", f"root@{net.hosts[0].address}",
                                  "true"], capture_output=True, text=True, timeout=30)
        assert refused.returncode == 255 and "Permission denied" in refused.stderr
        state_dir = ssh.workdir
    assert not state_dir.exists()


@pytest.fixture(scope="module")
def cluster():
    workdir = make_workdir()
    net = HostNetwork.up(HOSTS, cluster_mounts(workdir, HOSTS))
    try:
        with SshHosts(net) as ssh:
            ssh.start()
            for host in net.hosts:
                (ssh.home(host) / "kvtier-host").write_text(host.name)
            up = RayUp(net, ssh, workdir)
            started = time.monotonic()
            up.up()
            up.nodes = up.wait_nodes()
            up.up_s = time.monotonic() - started
            yield up
    finally:
        net.down()
        shutil.rmtree(workdir, ignore_errors=True)


@CLUSTER
@pytest.mark.timeout(600)
def test_ray_up_starts_the_projects_nodes_each_in_its_own_home(cluster) -> None:
    net = cluster.net
    by_ip = {n["ip"]: n["resources"] for n in cluster.nodes}
    assert set(by_ip) == {h.address for h in net.hosts}, (by_ip, cluster.up_s)
    head, *workers = net.hosts
    assert by_ip[head.address].get("kvtier_head") == 1
    assert "kvtier_instance" not in by_ip[head.address]
    for w in workers:
        assert by_ip[w.address].get("kvtier_instance") == 4
        assert "kvtier_head" not in by_ip[w.address]
    token = cluster.ray.token_path.read_text()
    for host in net.hosts:
        pids = ray_pids(host.pids())
        assert pids, f"no Ray process in {host.name}"
        for pid in pids:  # read through the process's own mount namespace
            root = Path(f"/proc/{pid}/root")
            assert environ(pid).get("HOME", SSH_HOME) == SSH_HOME, pid  # GCS: no HOME
            assert (root / "root/kvtier-host").read_text() == host.name, pid
            assert (root / "root/.ray/auth_token").read_text() == token, pid
    # what the project's start commands set: auth on, the address ray up reached the node at
    raylets = [p for h in net.hosts for p in ray_pids(h.pids())
               if b"raylet/raylet" in Path(f"/proc/{p}/cmdline").read_bytes()]
    assert len(raylets) == HOSTS
    assert all(environ(p).get("RAY_AUTH_MODE") == "token" for p in raylets)
    assert all(environ(p).get("HOME") == SSH_HOME for p in raylets)


def _http(url: str, body: dict | None = None, headers: dict | None = None,
          timeout_s: float = 120.0) -> tuple[int, dict]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as exc:
        return exc.code, {"error": exc.read().decode(errors="replace")}


def _rank_hosts(net) -> dict[str, int]:
    """Host name -> rank actor processes running in it."""
    out = {}
    for host in net.hosts:
        n = sum(b"Rank" in Path(f"/proc/{p}/cmdline").read_bytes()
                for p in ray_pids(host.pids()))
        if n:
            out[host.name] = n
    return out


@CLUSTER
@pytest.mark.timeout(900)
def test_serve_on_the_cluster_answers_from_another_hosts_l3_pages(cluster) -> None:
    head = cluster.net.hosts[0]
    base = f"http://{head.address}:{SERVE_PORT}"
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    log_path = cluster.workdir / "serve.log"
    # over ssh, as a user on the head would (no RAY_* variables: the node's own
    # /tmp/ray/ray_current_cluster and ~/.ray/auth_token are what `--address auto` finds)
    command = (f"cd ~/kvtier && exec .venv/bin/kvtier serve --address auto "
               f"--host {head.address} --port {SERVE_PORT} --instances 2 --tp 1 "
               f"--l3 mooncake --model tiny --chunk-tokens 64 --max-new-tokens 8 "
               f"--admin-key {ADMIN_KEY}")
    with open(log_path, "wb") as log:
        serve = subprocess.Popen(cluster.ssh.ssh_argv(head, command), stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-6000:]

    try:
        deadline = time.monotonic() + 420
        status = 0
        while status != 200:
            assert serve.poll() is None, f"kvtier serve exited {serve.returncode}:\n{log_tail()}"
            assert time.monotonic() < deadline, f"no healthy /health in 420 s:\n{log_tail()}"
            try:
                status, _ = _http(f"{base}/health", timeout_s=10)
            except (urllib.error.URLError, OSError):
                status = 0
            time.sleep(2)
        deadline = time.monotonic() + 60  # /health can answer before both ranks are up
        while sorted(ranks := _rank_hosts(cluster.net)) != ["host2", "host3"]:
            assert time.monotonic() < deadline, (
                f"the two instances' ranks should run on the two worker hosts (one each: "
                f"then any L3 hit on the other instance reads another host's pages), found "
                f"{ranks}:\n{log_tail()}")
            time.sleep(1)
        _, models = _http(f"{base}/v1/models")
        model = models["data"][0]["id"]
        prompt = "".join(PROMPT.format(i=i) for i in range(12))
        body = {"model": model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": 4, "temperature": 0}
        code, first = _http(f"{base}/v1/chat/completions", body)
        assert code == 200, first
        computed_by = first["kvtier"]["instance"]
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, first
        # Flush drops L1/L2 on every instance, L3 stays (pages being backed up stay too, so
        # the first answer after it may still be A's L2 hit). Then the router no longer
        # prefers A: flush and ask again until the other instance answers.
        for _ in range(12):
            assert _http(f"{base}/admin/flush", {}, headers=admin)[0] == 200
            time.sleep(2)  # backups in flight land (the router's storage_pages lags them)
            code, again = _http(f"{base}/v1/chat/completions", body)
            assert code == 200, again
            if again["kvtier"]["instance"] != computed_by:
                break
        assert again["kvtier"]["instance"] != computed_by, "the router never chose the other"
        assert again["kvtier"]["cached_tokens"]["storage"] > 0, again
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, again
        assert again["choices"][0]["message"]["content"] == \
            first["choices"][0]["message"]["content"]
        listeners = {h.name: sorted({(l.host, l.port) for l in listening(h.pids())})
                     for h in cluster.net.hosts}
        print("listening:", json.dumps(listeners))  # shown with -s: what listens where
        assert (head.address, SERVE_PORT) in listeners["host1"], listeners
    finally:
        serve.kill()  # the ssh client; `kvtier serve` stops with the hosts, by PID
        serve.wait(10)
