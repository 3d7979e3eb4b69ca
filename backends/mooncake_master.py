"""A `mooncake_master` subprocess on one address (127.0.0.1 by default): started on free
ports, watched, stopped. Which address is the caller's decision (under a namespace, the
namespace actor's: actors/l3/hosts.py); this module binds what it is told, never 0.0.0.0.

Why no HTTP metadata server: the master's embedded one (`--enable_http_metadata_server`)
binds 0.0.0.0 whatever `--http_metadata_server_host` says (Mooncake 0.3.13 passes only the
port to its HTTP server), so clients of a kvtier-started master use `P2PHANDSHAKE`
metadata instead: nothing to serve, and every master socket stays on its one address. With no
HTTP metadata there is nothing for `--enable_metadata_cleanup_on_timeout` to clean; the
short `--client_ttl` still unmounts a crashed client's segment within seconds.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

from kvtier.backends.base import StorageUnavailable
from kvtier.storage_options import AUTO_HOST, MooncakeOptions

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
BINARY = "mooncake_master"
CLIENT_TTL_S = 2  # a dead client's segment (and its objects) is dropped after this
POLL_S = 0.02
STOP_TIMEOUT_S = 5.0
START_ATTEMPTS = 3  # a free port can be taken between choosing it and the bind


def find_master_binary() -> str:
    """The `mooncake_master` of this environment: the venv's bin, the wheel, then PATH."""
    candidates = [Path(sys.executable).parent / BINARY]
    spec = importlib.util.find_spec("mooncake")  # the wheel ships it; found without importing
    if spec is not None and spec.origin:
        candidates.append(Path(spec.origin).parent / BINARY)
    on_path = shutil.which(BINARY)
    if on_path:
        candidates.append(Path(on_path))
    for path in candidates:
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    raise StorageUnavailable(
        f"{BINARY} not found (looked in {', '.join(map(str, candidates)) or 'PATH'}); install "
        "mooncake-transfer-engine (`make` does), or start a master yourself and set "
        "storage_options master_address")


def default_master_host(options: MooncakeOptions) -> str:
    """Where a master binds when no cluster is asked (a backend opened on its own, a namespace
    service outside Ray): `master_host`, or loopback for "auto"."""
    return LOOPBACK if options.master_host == AUTO_HOST else options.master_host


def free_port(host: str = LOOPBACK) -> int:
    """A port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def _check_bindable(host: str) -> None:
    """StorageUnavailable unless a server can listen on `host` here (one of this node's
    addresses): said before the master starts, instead of its bind failing in a log."""
    try:
        free_port(host)
    except (OSError, OverflowError) as exc:
        raise StorageUnavailable(
            f"the Mooncake master cannot bind {host!r} on node {socket.gethostname()} ({exc}); "
            "set storage_options master_host to an address of that node, or to 'auto'") from exc


def _kill(proc: subprocess.Popen, log_dir: str | None, timeout_s: float) -> None:
    """Stop the process (TERM, then KILL) and remove its log dir; safe to call twice."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout_s)
    if log_dir:
        shutil.rmtree(log_dir, ignore_errors=True)


class MooncakeMaster:
    """One master process, its ports and its log; `stop()` (or exit) ends it."""

    def __init__(self, start_timeout_s: float = 15.0, binary: str | None = None,
                 client_ttl_s: int = CLIENT_TTL_S, host: str = LOOPBACK) -> None:
        self.host = host  # --rpc_address and --metrics_host; kept across restarts by callers
        _check_bindable(host)
        self.binary = binary or find_master_binary()
        if not (os.path.isfile(self.binary) and os.access(self.binary, os.X_OK)):
            raise StorageUnavailable(f"{self.binary} is not an executable file; install "
                                     "mooncake-transfer-engine or fix the path")
        self.client_ttl_s = client_ttl_s
        self.log_dir = tempfile.mkdtemp(prefix="kvtier-mooncake-master-")
        self.log_path = os.path.join(self.log_dir, "master.log")
        self.proc: subprocess.Popen | None = None
        self._finalizer: weakref.finalize | None = None
        self.rpc_port = self.metrics_port = 0
        deadline = time.monotonic() + start_timeout_s
        try:
            for attempt in range(1, START_ATTEMPTS + 1):
                if self._start_once(deadline):
                    break
                if attempt == START_ATTEMPTS or time.monotonic() >= deadline:
                    raise StorageUnavailable(self._why_not_started(start_timeout_s))
                log.warning("mooncake master did not start (attempt %d); retrying on new ports",
                            attempt)
        except BaseException:
            self.stop()
            raise
        log.info("mooncake master pid %d on %s (metrics %s:%d)",
                 self.proc.pid, self.address, self.host, self.metrics_port)

    @property
    def address(self) -> str:
        """What clients pass as master_server_addr."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def command(self) -> list[str]:
        return [self.binary,
                f"--rpc_address={self.host}", f"--rpc_port={self.rpc_port}",
                f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
                "--enable_http_metadata_server=false",  # see the module docstring
                f"--client_ttl={self.client_ttl_s}",
                "--enable_metric_reporting=false",  # a 2 KB log line every few seconds
                "--logtostderr"]

    def _start_once(self, deadline: float) -> bool:
        """Launch on fresh ports; True once the RPC port accepts connections."""
        self.rpc_port, self.metrics_port = free_port(self.host), free_port(self.host)
        if self.proc is not None:  # an earlier attempt that failed
            self._finalizer.detach()
            _kill(self.proc, None, STOP_TIMEOUT_S)
        with open(self.log_path, "ab") as out:
            try:
                self.proc = subprocess.Popen(self.command(), stdin=subprocess.DEVNULL,
                                             stdout=out, stderr=subprocess.STDOUT, close_fds=True)
            except OSError as exc:
                raise StorageUnavailable(f"cannot run {self.binary}: {exc}") from exc
        # The process must not outlive the interpreter even when close() is never called.
        self._finalizer = weakref.finalize(self, _kill, self.proc, self.log_dir, STOP_TIMEOUT_S)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if port_open(self.host, self.rpc_port):
                return True
            time.sleep(POLL_S)
        return False

    def _why_not_started(self, timeout_s: float) -> str:
        code = self.proc.poll() if self.proc else None
        state = (f"exited with code {code}" if code is not None
                 else f"did not open its RPC port within {timeout_s:.1f} s")
        return (f"the Mooncake master {state}; command: {' '.join(self.command())}; last log "
                f"lines:\n{self.log_tail()}\nCheck that the binary runs on this machine "
                f"(Debian: apt-get install libibverbs1) and that ports on {self.host} are free, or "
                "raise storage_options start_timeout_s")

    def log_tail(self, lines: int = 15) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"".join(f.readlines()[-lines:]).decode(errors="replace").rstrip()
        except OSError:
            return "(no log)"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> None:
        """Terminate the master (kill it after `timeout_s`) and remove its log."""
        if self.proc is not None:
            self._finalizer.detach()
            _kill(self.proc, self.log_dir, timeout_s)
            log.info("mooncake master pid %d stopped (code %s)", self.proc.pid,
                     self.proc.returncode)
        else:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "MooncakeMaster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
