"""`kvtier serve --address auto` on a three-host cluster (token auth on; conftest's, which
test_cluster used before): the ingress on host 1, one TP=2 instance on host 2 and one on
host 3 (each worker offers one instance's `kvtier_instance`), the load generator in the root
namespace. Host 3's link is cut for 5 s while requests are in flight: Ray does not declare
the node dead that fast, so kvtier's router deadline (2 s) does it: the instance is marked
stalled, its unanswered requests are answered by the other instance, each exactly once and
equal to the answer before the cut, and once the link is back the instance steps again and
is taken back.

Twice: with a file L3 on a directory every host mounts, and with Mooncake (the master on
host 1, a segment in each rank, two copies of each object since the cluster spans hosts).
With Mooncake host 3's segments hold pages too: host 2's reads and writes that touch them
give up at the backend's deadline (misses, recomputed) or, once the master drops host 3's
segments, read the other copy; host 2 never waits for the link. After the cut every prompt
is answered again, equal to before."""
from __future__ import annotations

import concurrent.futures
import subprocess
import time
import urllib.error
import urllib.request

import pytest
from eventually import eventually
from http_client import ServeClient

from kvtier.cli.demo_hosts import HostsRun

pytestmark = pytest.mark.timeout(600)
PORT = 8000
ADMIN_KEY = "hosts-test-admin"
# ~410 tokens each (6 full pages of 64): past the prefetch threshold (256 tokens), so an
# instance without a prompt's pages in L1/L2 reads them from L3
PROMPTS = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog, and then " * 34
           for i in range(6)]
# What a joined deployment leaves on the cluster when it stops (Serve and the namespace actor,
# which holds kvtier_head): removed, so the shared cluster serves the next module as it was.
LEFT_BEHIND = """
import ray
from ray import serve
ray.init(log_to_driver=False)
serve.shutdown()
try:
    ray.kill(ray.get_actor("kvtier-l3", namespace="kvtier"))
except ValueError:  # the deployment never created it
    pass
"""


def _l3_args(l3: str, run: HostsRun) -> list[str]:
    if l3 == "file":
        return ["--l3", "file", "--l3-root", f"{run.shared_dir}/serve-l3"]
    return ["--l3", "mooncake"]  # the namespace actor's master on host 1; copies: auto (2)


@pytest.fixture(scope="module", params=["file", "mooncake"])
def served(request, hosts_cluster: HostsRun, tmp_path_factory):
    run, l3 = hosts_cluster, request.param
    h1 = run.net.hosts[0]
    log = open(tmp_path_factory.mktemp(f"serve-{l3}") / "serve.log", "w")
    proc = run.ray.driver_popen(
        ["-m", "kvtier", "serve", "--address", "auto", "--host", h1.address,
         "--port", str(PORT), "--instances", "2", "--tp", "2", "--model", "tiny",
         *_l3_args(l3, run), "--admin-key", ADMIN_KEY,
         "--stall-timeout-s", "2", "--max-new-tokens", "64",
         "--deterministic"],  # an L3 hit answers exactly as the cold run did
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://{h1.address}:{PORT}"
    try:
        _wait_healthy(base, proc, log.name)
        yield run, base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        run.ray.driver(["-c", LEFT_BEHIND], timeout_s=120)


def _wait_healthy(base: str, proc: subprocess.Popen, log_name: str, timeout_s: float = 300):
    def healthy() -> bool:
        if proc.poll() is not None:  # no use waiting on
            pytest.fail(f"kvtier serve exited {proc.returncode}; see {log_name}:\n"
                        + open(log_name).read()[-4000:])
        with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
            return r.status == 200

    eventually(healthy, timeout_s, f"kvtier serve became healthy (its log: {log_name})",
               retry_on=(urllib.error.URLError, OSError), interval_s=0.2)


def test_link_cut_redispatches_then_takes_the_instance_back(served) -> None:
    run, base = served
    client = ServeClient(base, "kvtier-tiny", ADMIN_KEY)
    h3 = run.net.hosts[2]
    reference = {p: client.complete(p, 48)["choices"][0]["text"] for p in PROMPTS}
    before = client.router()
    assert len(before) == 2 and all(i["state"] == "live" for i in before.values()), before
    client.flush()  # L1 and L2 emptied: the prompts are in L3

    h3.set_link(False)
    cut_at = time.monotonic()
    try:
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            futures = {p: pool.submit(client.complete, p, 48) for p in PROMPTS}
            time.sleep(max(0.0, 5.0 - (time.monotonic() - cut_at)))
    finally:
        h3.set_link(True)
    answers = {p: f.result(timeout=180) for p, f in futures.items()}
    for p, a in answers.items():
        assert len(a["choices"]) == 1 and a["choices"][0]["text"] == reference[p], (p, a)

    status = client.router()
    stalled = [n for n, i in status.items() if i["stalls"] > before[n]["stalls"]]
    assert len(stalled) == 1, (before, status)  # host 3's instance, and only it

    def live() -> bool:  # it steps again: taken back
        status = client.router()
        assert status[stalled[0]]["state"] == "live", status
        return True

    eventually(live, 120, f"{stalled[0]} was taken back", retry_on=(AssertionError,),
               interval_s=0.2)
    metrics = client.metrics()
    assert "kvtier_redispatched_requests_total" in metrics
    # L3 was written, and after the flush the prompts were looked up there (the ingress
    # refreshes the instances' counters in /metrics from time to time: poll)
    deadline = time.monotonic() + 60
    while not (_total(metrics, "kvtier_storage_backup_tokens_total") > 0
               and _total(metrics, "kvtier_hit_tokens_total", 'tier="storage"') > 0):
        assert time.monotonic() < deadline, [line for line in metrics.splitlines()
                                             if "storage" in line and "#" not in line]
        time.sleep(0.2)
        metrics = client.metrics()

    # everything serves again: every prompt, whichever instance answers, as before the cut
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        again = {p: pool.submit(client.complete, p, 48) for p in PROMPTS}
    for p, f in again.items():
        assert f.result(timeout=180)["choices"][0]["text"] == reference[p], p


def _total(metrics: str, family: str, label: str = "") -> float:
    """The sum of a counter family's samples (those with `label`) in a Prometheus page."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith((family + " ", family + "{")) and label in line)
