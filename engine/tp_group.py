"""Real tensor parallelism: a `torch.distributed` group per TP rank, and a process launcher.

`init_tp` is the rank side: it joins the group (gloo on CPU, NCCL when every rank has a GPU)
and returns the `TensorParallel` the model shards itself with. It needs nothing but its rank,
the size and a shared `tcp://host:port`, so a Ray actor (part 4) can call it as it is.
`run_tp` is the local launcher: one spawned process per rank runs `fn(tp, *args)`.

Everything listens on loopback when the address is loopback: torch's own tcp:// rendezvous
binds its store to every interface whatever host it is given, so rank 0 binds the store's
socket itself, and gloo's rank-to-rank sockets are pinned to `lo` by GLOO_SOCKET_IFNAME.
Every wait is bounded: a missing or dead rank is an error after `timeout_s`, never a hang.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
import sys
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable
from urllib.parse import urlparse

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

from kvtier.engine.model_config import ModelConfig
from kvtier.engine.parallel import TensorParallel
from kvtier.errors import ConfigError, KvtierError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 120.0
_STOP_GRACE_S = 3.0      # SIGTERM, then SIGKILL after this long
_ERROR_GRACE_S = 0.5     # after the first failure, how long to gather the other ranks' errors


class TPRunError(KvtierError, RuntimeError):
    """A TP rank failed, died or ran past the timeout. `rank` is the first failing rank (None
    on a timeout), `remote_traceback` its traceback text, `pids` the rank processes (all
    stopped by the time this is raised)."""

    def __init__(self, message: str, rank: int | None = None, remote_traceback: str = "",
                 pids: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.rank, self.remote_traceback, self.pids = rank, remote_traceback, pids


class TPJoinError(KvtierError, RuntimeError):
    """A rank could not form its TP group in time (a rank missing, or addresses that differ)."""


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` right now (another process may take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def loopback_init_method() -> str:
    """A fresh `tcp://127.0.0.1:<free port>` rendezvous address for one TP group."""
    return f"tcp://{LOOPBACK}:{free_port()}"


def choose_backend(size: int) -> str:
    """NCCL when CUDA is usable and every rank gets its own GPU, else gloo (CPU tensors)."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= size \
            and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def rank_device() -> torch.device:
    """The device this rank's model and pools belong on (its GPU under NCCL, else the CPU)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _parse(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ConfigError(f"init_method {init_method!r} is not tcp://host:port; use "
                          f"loopback_init_method() for a local group")
    return url.hostname, url.port


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _store(host: str, port: int, rank: int, size: int, timeout: timedelta) -> dist.TCPStore:
    if rank != 0:  # a client retries its connect until `timeout`: rank 0 may start later
        return dist.TCPStore(host, port, size, False, timeout)
    # Rank 0 hosts the store. Handed only a port, TCPStore listens on all interfaces; handed a
    # socket we bound, it listens where we chose (and we fail early when the port is taken).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"TP rank 0 cannot listen on {host}:{port} ({exc}); pick another "
                          f"port, e.g. with loopback_init_method()") from exc
    # The store owns the descriptor from here and closes it when it is destroyed.
    return dist.TCPStore(host, port, size, True, timeout, master_listen_fd=sock.detach())


def init_tp(rank: int, size: int, init_method: str, *, backend: str | None = None,
            timeout_s: float = DEFAULT_TIMEOUT_S, device_index: int | None = None
            ) -> TensorParallel:
    """Join TP group `init_method` as `rank` of `size`; the model's all-reduce then runs on it.

    All ranks must pass the same `init_method` (tcp://host:port, rank 0 listens there),
    `size` and `backend` (default: `choose_backend(size)`, the same on every rank only when
    all ranks see the same GPUs: a launcher should choose it once). Under NCCL the rank uses
    GPU `device_index` (default: its rank; pass 0 where each process sees only its own GPU,
    as in a Ray actor). Rendezvous and every collective give up after `timeout_s`. Call
    `destroy_tp()` when done.
    """
    TensorParallel(rank, size)  # validates rank and size before anything listens
    host, port = _parse(init_method)
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
    if dist.is_initialized():
        raise ConfigError("this process already belongs to a torch.distributed group; call "
                          "destroy_tp() before init_tp() again")
    backend = backend or choose_backend(size)
    if _is_loopback(host):
        # gloo binds its rank-to-rank sockets to the interface the hostname resolves to, which
        # may be external; a loopback group keeps all of its traffic on `lo`.
        os.environ["GLOO_SOCKET_IFNAME"] = "lo"
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    if backend == "nccl":
        index = rank if device_index is None else device_index
        if not 0 <= index < torch.cuda.device_count():
            raise ConfigError(f"NCCL rank {rank} needs GPU {index} but this process sees "
                              f"{torch.cuda.device_count()}; pass device_index, or use "
                              f"backend='gloo'")
        torch.cuda.set_device(index)
    timeout = timedelta(seconds=timeout_s)
    start = time.perf_counter()
    try:
        store = _store(host, port, rank, size, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    except dist.DistError as exc:  # store connect/wait timeouts: name the likely cause
        cause = str(exc).splitlines()[0].rstrip(".")
        raise TPJoinError(f"TP rank {rank} of {size} could not form its group at {init_method} "
                          f"within {timeout_s} s ({cause}); start all {size} ranks with the "
                          f"same init_method and size") from exc
    log.debug("TP rank %d/%d joined %s (%s) in %.2f s", rank, size, init_method, backend,
              time.perf_counter() - start)
    return TensorParallel(rank, size, group=dist.group.WORLD)


def destroy_tp() -> None:
    """Leave the TP group (no-op when this process is in none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(rank: int, size: int, init_method: str, backend: str, timeout_s: float,
               log_level: int, fn: Callable[..., Any], args: tuple, conn: Connection) -> None:
    """A rank process: join, run `fn`, send ("ok", result) or ("error", traceback text)."""
    torch.set_num_threads(1)  # ranks share the machine's cores: one thread each, no thrashing
    torch.set_num_interop_threads(1)
    logging.basicConfig(level=log_level,
                        format=f"%(asctime)s tp{rank}/{size} %(name)s %(levelname)s %(message)s")
    ok = False
    try:
        try:
            tp = init_tp(rank, size, init_method, backend=backend, timeout_s=timeout_s)
            result = fn(tp, *args)
            if dist.is_initialized():  # unless `fn` left the group itself
                dist.barrier()  # rank 0 hosts the store: none tears down while others work
            conn.send(("ok", result))
            ok = True
        except BaseException:  # noqa: BLE001 - every failure goes back to the launcher as text
            # Sent before leaving the group, so it reaches the launcher ahead of the errors
            # our departure causes in the other ranks: the first error is the cause.
            conn.send(("error", traceback.format_exc()))
        destroy_tp()
    finally:
        conn.close()
        # Nothing is left to clean up (group destroyed, result sent), and a normal interpreter
        # exit with torch loaded takes 0.5-1 s per rank: leave at once.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0 if ok else 1)


def _stop(procs: list[Any], exit_wait_s: float) -> None:
    """Reap every rank process: wait up to `exit_wait_s` for them to exit on their own (after
    sending their results), then SIGTERM, then SIGKILL the ones that ignore it."""
    deadline = time.monotonic() + exit_wait_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            log.warning("TP rank process %s ignored SIGTERM; killing it", proc.pid)
            proc.kill()
            proc.join()


def run_tp(fn: Callable[..., Any], size: int, *args: Any, timeout_s: float = DEFAULT_TIMEOUT_S,
           backend: str | None = None, init_method: str | None = None,
           config: ModelConfig | None = None) -> list[Any]:
    """Run `fn(tp, *args)` in `size` fresh processes, one per TP rank; results by rank.

    `fn` and `args` must pickle (a module-level function); results should be plain Python
    values. With `config`, a TP size that does not split it is a ConfigError before any
    process starts. Raises TPRunError naming the rank (with its traceback) when a rank fails
    or dies, or when `timeout_s` passes; every rank process is stopped before returning.
    """
    if size < 1:
        raise ConfigError(f"TP size must be >= 1, got {size}")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
    if config is not None:
        TensorParallel(0, size).check(config)
    backend = backend or choose_backend(size)
    init_method = init_method or loopback_init_method()
    ctx = tmp.get_context("spawn")  # fork would copy torch's threads and locks mid-state
    procs: list[Any] = []
    conns: dict[Connection, int] = {}
    start = time.monotonic()
    results: dict[int, Any] | None = None
    try:
        for rank in range(size):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=_rank_main, name=f"kvtier-tp{rank}", daemon=True,
                               args=(rank, size, init_method, backend, timeout_s,
                                     logging.getLogger().getEffectiveLevel(), fn, args, send))
            proc.start()
            send.close()  # keep only the child's end open: its exit then reads as EOF here
            procs.append(proc)
            conns[recv] = rank
        results = _collect(conns, procs, start + timeout_s, timeout_s)
    finally:
        # A failed run stops at once: its other ranks may sit in a collective for good.
        _stop(procs, _STOP_GRACE_S if results is not None else 0.0)
        for conn in conns:
            conn.close()
    log.info("TP run of %s on %d ranks (%s) took %.2f s", getattr(fn, "__name__", fn), size,
             backend, time.monotonic() - start)
    return [results[rank] for rank in range(size)]


def _collect(conns: dict[Connection, int], procs: list[Any], deadline: float,
             timeout_s: float) -> dict[int, Any]:
    """Every rank's result, or TPRunError for the first rank that failed."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    pending = dict(conns)
    pids = tuple(p.pid for p in procs)
    while pending:
        now = time.monotonic()
        if errors:
            deadline = min(deadline, now + _ERROR_GRACE_S)
        if now >= deadline:
            break
        for conn in wait(list(pending), timeout=deadline - now):
            rank = pending.pop(conn)
            try:
                status, payload = conn.recv()
            except EOFError:
                status, payload = "error", (f"rank {rank} exited with code "
                                            f"{_exitcode(procs[rank])} without a result "
                                            f"(killed, out of memory, or os._exit)")
            if status == "ok":
                results[rank] = payload
            else:
                errors[rank] = payload
    if errors:
        first = next(iter(errors))  # in arrival order: later ones are usually the fallout
        others = "".join(f"\n  rank {r}: {tb.strip().splitlines()[-1]}"
                         for r, tb in errors.items() if r != first)
        raise TPRunError(f"TP rank {first} of {len(procs)} failed; its traceback:\n"
                         f"{errors[first].rstrip()}"
                         + (f"\nother ranks failed too:{others}" if others else ""),
                         first, errors[first], pids)
    if pending:
        late = sorted(pending.values())
        raise TPRunError(f"TP ranks {late} of {len(procs)} did not finish within {timeout_s} s; "
                         f"raise timeout_s if the work is just slow, else look for a rank "
                         f"stuck in a collective the others skipped", None, "", pids)
    return results


def _exitcode(proc: Any) -> int | None:
    proc.join(1.0)  # the pipe closes a moment before the process is reaped
    return proc.exitcode
