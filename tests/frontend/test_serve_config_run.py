"""examples/serve_config.yaml brought up as its comment says: Ray Serve's own `serve run
CONFIG` against a Ray head started with `ray start --head` (on 127.0.0.1, in a temporary
directory), then one chat completion and the running config read back over HTTP.

The copy that runs changes two things only: the HTTP port (a free one: 8000 may be taken on
this machine) and `l3_root` (a directory of this test, removed afterwards; the example's ""
would leave a temporary directory behind). Everything else, SmolLM2 included, is the example.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator, NamedTuple

import pytest
import requests
import yaml
from eventually import eventually
from http_client import ServeClient

from kvtier.actors.ray_env import LOOPBACK, LOOPBACK_ENV, NO_AUTH_ENV
from kvtier.engine.tp_group import free_port
from kvtier.netcheck import listening
from kvtier.frontend.settings import ServeSettings

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "serve_config.yaml"
BIN = Path(sys.executable).parent
HEAD_CPUS = 2
OBJECT_STORE_BYTES = 128 << 20
UP_S = 150.0  # `serve run` until /health answers with every instance (~20 s when idle)
STOP_S = 60.0  # each of `serve run` and the head, after its signal
HEAD_STARTS = 3  # a head that exits at start (a port taken meanwhile) is started again
HEAD_LOGS = ("gcs_server.out", "gcs_server.err", "raylet.out", "raylet.err")  # in the session
LOG_TAIL = 3000  # characters of each log a failure quotes

pytestmark = pytest.mark.timeout(300)


class Head(NamedTuple):
    process: subprocess.Popen  # `ray start --head --block`: its session holds the cluster
    address: str
    temp_dir: str


def ray_env() -> dict[str, str]:
    """This environment, pinned to loopback without token auth, as kvtier's own local
    clusters are (actors/ray_env.py), and joining no cluster by default."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    return {**env, **LOOPBACK_ENV, **NO_AUTH_ENV, "RAY_USAGE_STATS_ENABLED": "0"}


def session_pids(sid: int) -> set[int]:
    """Every live process of session `sid` (the head's: Ray's processes and its workers)."""
    pids = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.isdigit() and int(fields[3]) == sid and fields[0] != "Z":
            pids.add(int(entry))
    return pids


def kill_session(sid: int) -> None:
    for pid in session_pids(sid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def ctrl_c_as_in_a_terminal() -> None:
    """In the child: SIGINT back to its default. A shell starts background jobs (`cmd &`
    without job control, as CI may) with SIGINT ignored, children inherit that, and a Python
    started with SIGINT ignored never raises KeyboardInterrupt: `serve run` would not see
    its Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(process: subprocess.Popen, sig: int, timeout_s: float) -> int | None:
    """Signal `process` and wait for it; its exit code, or None if it is still running."""
    if process.poll() is None:
        process.send_signal(sig)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        return None


@pytest.fixture
def head() -> Iterator[Head]:
    """A one-node Ray cluster on 127.0.0.1, started the way an operator would."""
    temp_dir = tempfile.mkdtemp(prefix="kvr-")  # short: Ray's socket paths live below it
    # Serve is shut down before the head stops: no drain to wait for (Ray's default is 30 s)
    env = {**ray_env(), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    process = None
    try:
        for _ in range(HEAD_STARTS):
            # ports free now may be taken before the head binds them (the suite runs other
            # tests meanwhile): a head that exits is started again on fresh ports
            port = free_port()
            argv = [str(BIN / "ray"), "start", "--head", "--block",
                    f"--node-ip-address={LOOPBACK}", f"--port={port}",
                    f"--num-cpus={HEAD_CPUS}", f"--object-store-memory={OBJECT_STORE_BYTES}",
                    "--include-dashboard=false", "--disable-usage-stats",
                    f"--temp-dir={temp_dir}", f"--ray-client-server-port={free_port()}",
                    f"--dashboard-agent-listen-port={free_port()}"]
            with open(os.path.join(temp_dir, "head.out"), "ab") as out:
                process = subprocess.Popen(argv, env=env, start_new_session=True,
                                           stdout=out, stderr=subprocess.STDOUT)
            address = f"{LOOPBACK}:{port}"
            # a driver joins only once the head's node registered: `serve run` started sooner
            # exits ("No node info found"), as it once did on a loaded machine
            try:
                eventually(lambda: process.poll() is not None or joinable(address), UP_S,
                           "the Ray head took a driver",
                           retry_on=(AssertionError,),
                           interval_s=0.5)
            except AssertionError as exc:
                pytest.fail(f"{exc}\n{head_logs(temp_dir)}")
            if process.poll() is None:
                break
            kill_session(process.pid)
            process.wait(10)
        else:
            pytest.fail(f"the Ray head exited at start {HEAD_STARTS} times (exit code "
                        f"{process.returncode})")
        yield Head(process, address, temp_dir)
        # `ray start --block` stops its node on SIGTERM (the raylet ends its workers)
        assert stop(process, signal.SIGTERM, STOP_S) is not None, "the Ray head did not stop"
        # workers may take a moment after the raylet
        eventually(lambda: not session_pids(process.pid), 10,
                   "the Ray processes ended with the head", interval_s=0.2)
    finally:
        if process is not None:
            process.kill()
            kill_session(process.pid)
            process.wait(10)
        shutil.rmtree(temp_dir, ignore_errors=True)


def joinable(address: str) -> bool:
    """True once a driver (another process, as `serve run` is) joins the cluster at
    `address`; AssertionError with the driver's output when it did not."""
    probe = ("import ray; ray.init(address=%r, log_to_driver=False, "
             "include_dashboard=False); ray.shutdown()" % address)
    try:
        run = subprocess.run([sys.executable, "-c", probe], env=ray_env(), timeout=60,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    except subprocess.TimeoutExpired as exc:
        said = (exc.output or b"").decode(errors="replace")[-LOG_TAIL:]
        raise AssertionError(f"a driver did not join within {exc.timeout:g} s: {said}") from exc
    assert run.returncode == 0, (f"a driver exited {run.returncode}: "
                                 f"{run.stdout.decode(errors='replace')[-LOG_TAIL:]}")
    return True


def head_logs(temp_dir: str) -> str:
    """The tails of the head's own output and of its session's GCS and raylet logs: what a
    head that took no driver said (the temporary directory goes with the fixture)."""
    logs = os.path.join(temp_dir, "session_latest", "logs")
    parts = []
    for path in [os.path.join(temp_dir, "head.out")] + [os.path.join(logs, n) for n in HEAD_LOGS]:
        try:
            with open(path, errors="replace") as f:
                text = f.read()[-LOG_TAIL:]
        except OSError as exc:
            text = f"({exc})"
        parts.append(f"--- {path}:\n{text}")
    return "\n".join(parts)


def config_copy(tmp_path: Path) -> tuple[Path, dict]:
    """The example with a free HTTP port and this test's L3 directory; the path and the
    config as loaded."""
    config = yaml.safe_load(CONFIG.read_text())
    config["http_options"]["port"] = free_port()
    (tmp_path / "l3").mkdir()
    config["applications"][0]["args"]["l3_root"] = str(tmp_path / "l3")
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, config


def wait_up(base: str, serve_run: subprocess.Popen, instances: int, log: Path) -> None:
    """Until /health reports every instance (bounded); fails at once if `serve run` exits."""
    def up() -> bool:
        if serve_run.poll() is not None:  # no use waiting on
            pytest.fail(f"serve run exited: {log.read_text()[-4000:]}")
        try:
            health = requests.get(f"{base}/health", timeout=5)
            ok = health.status_code == 200 and health.json().get("instances") == instances
        except (requests.RequestException, ValueError) as exc:
            ok = False
            health = exc
        assert ok, f"/health: {health}; serve run's log:\n{log.read_text()[-4000:]}"
        return True

    eventually(up, UP_S, f"every instance ({instances}) was up", retry_on=(AssertionError,),
               interval_s=0.2)


def test_the_example_serve_config_runs_with_serve_run(head: Head, tmp_path: Path) -> None:
    path, config = config_copy(tmp_path)
    args = config["applications"][0]["args"]
    settings = ServeSettings.from_mapping(args)
    http = config["http_options"]
    base = f"http://{http['host']}:{http['port']}"
    log = tmp_path / "serve_run.log"
    with log.open("wb") as out:
        serve_run = subprocess.Popen([str(BIN / "serve"), "run", "--address", head.address,
                                      str(path)], env=ray_env(), start_new_session=True,
                                     stdout=out, stderr=subprocess.STDOUT,
                                     preexec_fn=ctrl_c_as_in_a_terminal)
    try:
        wait_up(base, serve_run, settings.instances, log)

        answer = ServeClient(base, settings.served_model_name).chat(
            [{"role": "user", "content": "Say hello."}], 8)
        assert answer["choices"][0]["message"]["content"]
        assert answer["usage"]["completion_tokens"] == 8

        admin = {"Authorization": f"Bearer {args['admin_key']}"}
        r = requests.get(f"{base}/admin/config", headers=admin, timeout=60)
        assert r.status_code == 200, r.text
        running = r.json()["instances"]
        assert len(running) == args["instances"]
        for inst in running:
            hicache = inst["hicache"]
            assert {k: hicache[k] for k in args["hicache"]} == args["hicache"], hicache
            assert hicache["hicache_ratio"] == args["hicache_ratio"]
            assert hicache["enable_hierarchical_cache"] is True
            assert inst["l3"] == args["storage_backend"]
            assert inst["device_pages"] == args["device_pages"]
            assert inst["host_pages"] == int(args["device_pages"] * args["hicache_ratio"])

        # Serve's HTTP proxy is on the yaml's loopback address, and nothing of the cluster
        # (Ray's processes, Serve's, the replicas, the ranks) listens anywhere else.
        found = listening(session_pids(head.process.pid) | {serve_run.pid})
        assert (http["host"], http["port"]) in {(l.host, l.port) for l in found}, found
        assert {l.host for l in found} <= {LOOPBACK, "::1"}, found

        # Ctrl-C: `serve run` shuts Serve down (the app, its replicas, the proxy) and exits
        assert stop(serve_run, signal.SIGINT, STOP_S) is not None, log.read_text()[-4000:]
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{base}/health", timeout=5)
    finally:
        if serve_run.poll() is None:
            serve_run.kill()
            kill_session(serve_run.pid)
            serve_run.wait(10)
