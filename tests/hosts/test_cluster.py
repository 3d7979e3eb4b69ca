"""kvtier across three hosts of this machine (network namespaces on a private bridge), one
Ray cluster with token auth (conftest's, shared with test_serve_hosts): the head (namespace
actor, Mooncake master) on host 1, instances on hosts 2 and 3, drivers inside host 1.

Listeners: Ray 2.60's gcs_server, raylets, core-worker gRPC servers and agents bind the
wildcard address whenever a node's address is not loopback (Ray has no option to bind one
address), and Mooncake 0.3.13's transfer engine binds 0.0.0.0 and :: in every client (no
option either). In a host namespace the wildcard covers that host's address and loopback
only (test_network checks each host has just those two). Everything kvtier starts itself
(the Mooncake master) binds the host's address.
"""
from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from eventually import eventually

from kvtier.cli.demo import DemoParams
from kvtier.cli.demo_hosts import HostsRun, run_demo
from kvtier.hosts.ray_nodes import SCRUBBED
from kvtier.netcheck import listening

pytestmark = pytest.mark.timeout(900)

_rng = random.Random(11)
PAGE = 16


def _prompt(pages: int = 4) -> list[int]:
    return [_rng.randrange(1, 256) for _ in range(pages * PAGE + 5)]


@pytest.fixture(scope="module")
def run(hosts_cluster) -> HostsRun:
    # (conftest) workers offer kvtier_instance 2 and 2 CPUs: one TP=2 instance each, and
    # a second one placed by its node; a killed raylet is declared dead after ~3 s
    return hosts_cluster


class Driver:
    """tests/hosts/cluster_driver.py inside host 1; `call(op, **fields)` -> its answer."""

    def __init__(self, run: HostsRun, log_path) -> None:
        self.log = open(log_path, "w")
        self.proc = run.ray.driver_popen(["tests/hosts/cluster_driver.py"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self.log, text=True, bufsize=1)
        assert self._read().get("ready"), "the driver did not start"

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise AssertionError(f"the driver exited {self.proc.wait(10)}; see {self.log.name}")
            if line.startswith("@@ "):
                return json.loads(line[3:])

    def call(self, op: str, **fields) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        answer = self._read()
        return answer

    def ok(self, op: str, **fields) -> dict:
        answer = self.call(op, **fields)
        assert "ok" in answer, answer
        return answer["ok"]

    def close(self) -> None:
        try:
            self.call("close")
        finally:
            self.proc.stdin.close()
            self.proc.wait(60)
            self.log.close()


@pytest.fixture(scope="module")
def driver(run, tmp_path_factory):
    d = Driver(run, tmp_path_factory.mktemp("driver") / "driver.log")
    yield d
    d.close()


def test_demo_on_three_hosts_answers_as_cold(run) -> None:
    params = DemoParams(l3="mooncake", tokens=512, new_tokens=6, progress=False, tp_size=1,
                        dtype="fp32")
    result, _ = run_demo(run, params)
    assert result["identical"] is True, result["requests"]
    assert result["tiers_as_expected"] is True, result["requests"]
    l3 = [r for r in result["requests"] if r["tier"] == "L3"]
    assert l3 and l3[0]["instance"] == "B" and l3[0]["cached"]["storage"] == 512
    assert result["placement"]["A"] != result["placement"]["B"]
    # A's KV went from host 2 to the Mooncake segments and back to B on host 3
    assert result["bytes_sent_by_host"]["host2"] > 0 and result["bytes_across_hosts"] > 0


# A refused GCS connection is tried once: Ray retries it 20 times a second apart (~20 s
# for the wrong token), and the refusal is the same on every try.
ONE_TRY = {"RAY_NUM_REDIS_GET_RETRIES": "1"}


def test_auth_refuses_clients_without_the_token(run) -> None:
    # (every other test's driver joins with the token: the positive case)
    probe = ["-c", "import ray; ray.init(address='auto'); print(len(ray.nodes()))"]
    for env in ({"RAY_AUTH_TOKEN_PATH": "/nonexistent"}, {"RAY_AUTH_TOKEN": "0" * 64}):
        bad = run.ray.head.run([sys.executable, *probe],
                               env=run.ray.env(with_token=False, RAY_ADDRESS=run.ray.address,
                                               **ONE_TRY, **env), check=False, unset=SCRUBBED)
        assert bad.returncode != 0, bad.stdout
        assert "AuthenticationError" in bad.stderr or "Failed to connect" in bad.stderr, \
            bad.stderr[-2000:]


def _pids_named(host, name: str) -> list[int]:
    out = []
    for pid in host.pids():
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    out.append(pid)
        except OSError:
            continue
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _wildcard_budget(pid: int) -> float:
    """How many wildcard listeners a process may hold: Ray's daemons and agents any; a
    process running Ray's core worker (a driver or an actor) one for its gRPC server, plus
    two when it runs a Mooncake client (the transfer engine's handshake and TCP listeners)."""
    cmd = _cmdline(pid)
    if cmd.split(" ")[0].endswith(("gcs_server", "raylet")) \
            or cmd.startswith(("ray::DashboardAgent", "ray::RuntimeEnvAgent")) \
            or "/ray/dashboard/" in cmd or "/ray/_private/runtime_env/" in cmd:
        return float("inf")
    try:
        with open(f"/proc/{pid}/maps") as f:
            maps = f.read()
    except OSError:
        return 0
    return ("_raylet.so" in maps) + 2 * ("mooncake" in maps)


def test_l3_across_hosts_and_listeners_per_host(run, driver) -> None:
    h1, h2, h3 = run.net.hosts
    driver.ok("namespace", backend="mooncake")
    assert driver.ok("instance", name="A", node=h2.address)["nodes"] == [h2.address] * 2
    assert driver.ok("instance", name="B", node=h3.address)["nodes"] == [h3.address] * 2
    prompt = _prompt()
    cold = driver.ok("generate", name="A", prompt=prompt)
    assert cold["cached"]["storage"] == 0
    driver.ok("quiesce", name="A")
    hit = driver.ok("generate", name="B", prompt=prompt)
    assert hit["cached"]["storage"] == 4 * PAGE and hit["tokens"] == cold["tokens"]

    masters = _pids_named(h1, "mooncake_master")
    assert masters, "no Mooncake master on host 1"
    for pid in masters:
        hosts = {l.host for l in listening([pid])}
        assert hosts == {h1.address}, hosts  # kvtier binds the head's address, nothing else
    for host in run.net.hosts:
        found = listening(host.pids())
        assert found
        wild: dict[int, int] = {}
        for l in found:
            if l.host not in (host.address, "127.0.0.1", "::1"):
                assert l.host in ("0.0.0.0", "::"), l
                wild[l.pid] = wild.get(l.pid, 0) + 1
        for pid, n in wild.items():
            assert n <= _wildcard_budget(pid), (host.name, pid, n, _cmdline(pid))
    driver.ok("drop", name="A")
    driver.ok("drop", name="B")


def test_file_root_must_be_a_shared_mount(run, driver) -> None:
    h1, h2, h3 = run.net.hosts
    # host 1's own /tmp: the namespace actor writes its marker there, host 2 cannot see it
    driver.ok("namespace", backend="file", root="/tmp/kvtier-node-local-l3")
    refused = driver.call("instance", name="A", node=h2.address)
    assert "error" in refused, refused
    assert "root_dir" in refused["error"] and "a filesystem mounted on every node" in \
        refused["error"], refused["error"]

    driver.ok("namespace", backend="file", root=f"{run.shared_dir}/l3-file")
    driver.ok("instance", name="A", node=h2.address)
    driver.ok("instance", name="B", node=h3.address)
    prompt = _prompt()
    cold = driver.ok("generate", name="A", prompt=prompt)
    driver.ok("quiesce", name="A")
    hit = driver.ok("generate", name="B", prompt=prompt)
    assert hit["cached"]["storage"] == 4 * PAGE and hit["tokens"] == cold["tokens"]
    driver.ok("drop", name="A")
    driver.ok("drop", name="B")


def test_mooncake_master_restart_misses_then_hits(run, driver) -> None:
    h1, h2, h3 = run.net.hosts
    driver.ok("namespace", backend="mooncake")
    driver.ok("instance", name="A", node=h2.address)
    driver.ok("instance", name="B", node=h3.address)
    before = _prompt()
    driver.ok("generate", name="A", prompt=before)
    driver.ok("quiesce", name="A")
    masters = _pids_named(h1, "mooncake_master")
    for pid in masters:
        subprocess.run(["kill", "-9", str(pid)], check=True)
    # the master is gone with every object it knew: B misses what A had stored
    miss = driver.ok("generate", name="B", prompt=before)
    assert miss["cached"]["storage"] == 0, miss
    eventually(lambda: set(_pids_named(h1, "mooncake_master")) - set(masters), 60,
               "the namespace actor restarted the master", interval_s=0.5)

    def hits_again() -> tuple[dict, dict]:
        after = _prompt()
        cold = driver.ok("generate", name="A", prompt=after)
        driver.ok("quiesce", name="A")
        hit = driver.ok("generate", name="B", prompt=after)
        assert hit["cached"]["storage"], hit
        return cold, hit

    cold, hit = eventually(hits_again, 60, "the ranks re-attached to the new master and hit "
                           "again", retry_on=(AssertionError,), interval_s=0.0)
    assert hit["cached"]["storage"] == 4 * PAGE, hit
    assert hit["tokens"] == cold["tokens"]
    driver.ok("drop", name="A")
    driver.ok("drop", name="B")


def test_raylet_killed_instance_replaced_on_another_host(run, driver) -> None:
    h1, h2, h3 = run.net.hosts
    driver.ok("namespace", backend="mooncake")
    b_nodes = driver.ok("instance", name="B")["nodes"]  # anywhere offering kvtier_instance
    victim = h2 if b_nodes[0] == h2.address else h3
    other = h3 if victim is h2 else h2
    driver.ok("instance", name="A", node=other.address)
    prompt = _prompt(6)
    cold = driver.ok("generate", name="A", prompt=prompt)
    driver.ok("start", name="B", prompt=prompt)
    run.ray.kill_raylet(victim)  # every Ray process of that host, raylet first
    answer = driver.ok("join", name="B")
    assert "result" in answer, answer
    assert answer["result"]["tokens"] == cold["tokens"]  # nothing lost, nothing wrong
    stats = driver.ok("stats", name="B")
    assert stats["restarts"] >= 1
    assert driver.ok("where", name="B")["nodes"] == [other.address] * 2
    driver.ok("drop", name="A")
    driver.ok("drop", name="B")
    run.ray.start_worker(victim)  # as it was: test_serve_hosts places on it next
