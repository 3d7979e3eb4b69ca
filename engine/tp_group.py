"""Real tensor parallelism: a `torch.distributed` group per TP rank.

`init_tp` is the rank side: it joins the group (gloo on CPU, NCCL when every rank has a GPU)
and returns the `TensorParallel` the model shards itself with. It needs nothing but its rank,
the size and a shared `tcp://host:port`, so a Ray actor (actors/rank_actor) calls it as it is.

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
import time
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from kvtier.engine.parallel import TensorParallel
from kvtier.errors import ConfigError, KvtierError

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
DEFAULT_TIMEOUT_S = 120.0


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
