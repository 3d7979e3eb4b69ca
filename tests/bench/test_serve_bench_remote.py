"""`kvtier bench serve --base-url` against a real OpenAI-compatible server started outside the
bench: `kvtier serve --model tiny` in a subprocess (one instance, its own local Ray on
127.0.0.1 with 2 CPUs and a 128 MiB object store, as `actors.ray_env.start_local_ray` starts
it, HTTP on 127.0.0.1), 64-token chunks so round 2 reuses round 1's history. The bench runs
as a second subprocess with tiny sizes; the server is stopped in a `finally` (SIGINT, then
its whole process group if it does not exit)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest
from eventually import eventually

import kvtier.cli.main as cli
from kvtier.engine.tp_group import free_port

pytestmark = pytest.mark.timeout(180)
MODEL = "kvtier-tiny"  # what `kvtier serve --model tiny` serves as
API_KEY = "sk-remote-test-key"
READY = "kvtier: serving "  # its line once the app is up
START_S = 90.0  # ~20 s here: Ray, Serve, one instance of the tiny model
STOP_S = 30.0


def wait_serving(proc: subprocess.Popen, log: Path) -> None:
    """Until kvtier serve says it serves (it prints that once Serve reports the app ready)."""
    def serving() -> bool:
        text = log.read_text()
        if proc.poll() is not None:  # no use waiting on
            pytest.fail(f"kvtier serve exited {proc.returncode}:\n{text[-4000:]}")
        assert READY in text, text[-4000:]
        return True

    eventually(serving, START_S, "kvtier serve said it serves", retry_on=(AssertionError,),
               interval_s=0.2)


def stop(proc: subprocess.Popen) -> None:
    """SIGINT (kvtier serve then stops Serve and its Ray); what is left after STOP_S, the
    server's own process group (its Ray processes with it), is killed."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(STOP_S)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(STOP_S)


@pytest.fixture
def tiny_server(tmp_path: Path) -> Iterator[str]:
    port = free_port()
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier", "serve", "--model", "tiny", "--instances", "1",
             "--host", "127.0.0.1", "--port", str(port), "--device-pages", "32",
             "--chunk-tokens", "64", "--max-new-tokens", "16", "--l3", "none",
             "--api-key", API_KEY],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # its own process group: stop() can reach all of it
        try:
            wait_serving(proc, log)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop(proc)


def test_bench_serve_with_base_url_against_kvtier_serve(tiny_server: str, capsys) -> None:
    rc = cli.main(["bench", "serve", "--base-url", tiny_server + "/v1",
                   "--served-model-name", MODEL, "--clients", "2", "--rounds", "2",
                   "--first-turn-tokens", "150", "--turn-tokens", "10", "--max-tokens", "4",
                   "--timeout", "45", "--api-key", API_KEY, "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err[-4000:]
    out = json.loads(captured.out)
    assert (out["planned"], out["answered"], out["errors"]) == (4, 4, 0), out
    assert out["model"] == MODEL and out["settings"]["base_url"] == tiny_server
    assert out["cached_tokens_reported"] is True
    # round 2 resends round 1 (about 200 tokens): its whole 64-token pages come back cached
    assert 0.3 < out["hit_rate_after_round1"] < 1.0, out
    assert sum(out["cached_tokens"].values()) == out["cached_prompt_tokens"] > 0
    assert all(t is not None and t > 0 for t in out["ttft_by_round_s"])
    assert "off" not in out and API_KEY not in captured.out
    for path in ("/v1/models", "/v1/chat/completions"):  # the key is required
        request = urllib.request.Request(tiny_server + path, method="GET" if "models" in path
                                         else "POST", data=None if "models" in path else b"{}")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(request, timeout=30)
        assert err.value.code == 401
