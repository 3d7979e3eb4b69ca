"""The hardware ceilings the tiers move pages against, measured on this machine.

`measure_limits(l3_dir)` times, best of a few rounds each and bounded in time:

- `memory_copy_gbps`: one large tensor copy in host memory, bytes copied per second (each byte
  read once and written once): the L1 <-> L2 ceiling when L1 lives on the CPU.
- `pinned_h2d_gbps`, `pinned_d2h_gbps` (CUDA only, else None): pinned host <-> device copies,
  the L2 -> L1 load-back and L1 -> L2 backup ceilings on a GPU.
- `file_write_gbps`: a sequential write of one file in `l3_dir`, fsync included.
- `file_read_gbps`: a sequential read of that file after asking the kernel to drop it from the
  page cache (fsync, then posix_fadvise DONTNEED). `file_read_uncached` says whether that was
  possible; when it is False (no fadvise, or `l3_dir` on tmpfs/ramfs, whose pages ARE the
  page cache) the figure is a page-cache read: memory speed, not the device's. Even when True,
  a filesystem that ignores the hint serves the read from memory: compare with
  `memory_copy_gbps` before believing a read faster than the write.
- `loopback_tcp_gbps`: a sender thread and a receiver over one 127.0.0.1 TCP connection with
  large buffers: the ceiling of Mooncake's TCP transport between processes on one host.

All figures are decimal GB/s (10**9 bytes per second).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from typing import Callable, NamedTuple

import torch

GB = 10**9
MiB = 1 << 20
ROUNDS = 3
ROUND_BUDGET_S = 20.0  # after the first round, stop a measurement once it has run this long
IO_BLOCK = 8 * MiB
SOCKET_BUFFER = 4 * MiB
SOCKET_TIMEOUT_S = 60.0
MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs"})


class Limits(NamedTuple):
    """Ceilings in GB/s; the pinned figures are None without CUDA."""

    memory_copy_gbps: float
    pinned_h2d_gbps: float | None
    pinned_d2h_gbps: float | None
    file_write_gbps: float
    file_read_gbps: float
    loopback_tcp_gbps: float
    file_read_uncached: bool = False  # the read's pages were dropped from the page cache first
    l3_filesystem: str = "unknown"  # the filesystem type of l3_dir, from /proc/mounts

    def to_json(self) -> dict:
        return {k: (round(v, 3) if isinstance(v, float) else v)
                for k, v in self._asdict().items()}


class Sizes(NamedTuple):
    memory_bytes: int
    file_bytes: int
    tcp_bytes: int


FULL = Sizes(256 * MiB, 256 * MiB, 512 * MiB)
QUICK = Sizes(64 * MiB, 64 * MiB, 128 * MiB)


def measure_limits(l3_dir: str, quick: bool = False, *, size_scale: float = 1.0) -> Limits:
    """Measure every ceiling (see the module docstring); `size_scale` shrinks the transfers
    (tests use tiny ones)."""
    sizes = Sizes(*(max(MiB, int(n * size_scale)) for n in (QUICK if quick else FULL)))
    h2d = d2h = None
    if torch.cuda.is_available():
        h2d, d2h = pinned_copy_gbps(sizes.memory_bytes)
    write, read, uncached = file_gbps(l3_dir, sizes.file_bytes)
    return Limits(memory_copy_gbps(sizes.memory_bytes), h2d, d2h, write, read,
                  loopback_tcp_gbps(sizes.tcp_bytes), uncached, filesystem_type(l3_dir))


def best_of(fn: Callable[[], float], rounds: int = ROUNDS,
            budget_s: float = ROUND_BUDGET_S) -> float:
    """The shortest of up to `rounds` timings of `fn` (which returns seconds); rounds after
    the first run only while the total stays under `budget_s`."""
    start, best = time.perf_counter(), float("inf")
    for _ in range(rounds):
        best = min(best, fn())
        if time.perf_counter() - start > budget_s:
            break
    return best


def memory_copy_gbps(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # zeros: both buffers are touched up front
    dst.copy_(src)  # warm-up: page faults and thread start-up are not the copy's cost

    def once() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    return nbytes / best_of(once, rounds=5) / GB


def pinned_copy_gbps(nbytes: int) -> tuple[float, float]:
    """(host -> device, device -> host) GB/s between pinned host memory and the GPU."""
    host = torch.ones(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def timed(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], float]:
        def once() -> float:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        once()  # warm-up
        return once

    return (nbytes / best_of(timed(dev, host)) / GB, nbytes / best_of(timed(host, dev)) / GB)


def file_gbps(directory: str, nbytes: int) -> tuple[float, float, bool]:
    """(write GB/s with fsync, read GB/s, whether the read's pages were dropped first)."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f".kvtier-limits-{os.getpid()}-{threading.get_ident()}")
    block = memoryview(os.urandom(IO_BLOCK))  # incompressible
    buf = bytearray(IO_BLOCK)
    uncached = hasattr(os, "posix_fadvise") and filesystem_type(directory) not in MEMORY_FS
    write_s, read_s = float("inf"), float("inf")
    try:
        start = time.perf_counter()
        for _ in range(ROUNDS):
            write_s = min(write_s, _write_file(path, block, nbytes))
            uncached = drop_cached(path) and uncached
            read_s = min(read_s, _read_file(path, buf))
            if time.perf_counter() - start > ROUND_BUDGET_S:
                break
    finally:
        if os.path.exists(path):
            os.remove(path)
    return nbytes / write_s / GB, nbytes / read_s / GB, uncached


def _write_file(path: str, block: memoryview, nbytes: int) -> float:
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, block[:min(left, len(block))])
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def drop_cached(path: str) -> bool:
    """Ask the kernel to forget the file's (clean, fsynced) pages; False if it cannot."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _read_file(path: str, buf: bytearray) -> float:
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        while fh.readinto(view):
            pass
    return time.perf_counter() - t0


def loopback_tcp_gbps(nbytes: int) -> float:
    """Best of a few transfers of `nbytes` over one 127.0.0.1 connection."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(SOCKET_TIMEOUT_S)
        port = server.getsockname()[1]
        go, done = threading.Event(), threading.Event()
        failure: list[BaseException] = []
        sender = threading.Thread(target=_send, name="kvtier-limits-tcp", daemon=True,
                                  args=(port, nbytes, go, done, failure))
        sender.start()
        conn, _ = server.accept()
    with conn:
        conn.settimeout(SOCKET_TIMEOUT_S)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        view = memoryview(bytearray(SOCKET_BUFFER))

        def once() -> float:
            t0 = time.perf_counter()
            go.set()
            left = nbytes
            while left > 0:
                got = conn.recv_into(view[:min(left, len(view))])
                if not got:
                    raise ConnectionError(f"loopback sender stopped: {failure or 'closed'}")
                left -= got
            return time.perf_counter() - t0

        try:
            return nbytes / best_of(once) / GB
        finally:
            done.set()
            go.set()
            conn.close()
            sender.join(SOCKET_TIMEOUT_S)


def _send(port: int, nbytes: int, go: threading.Event, done: threading.Event,
          failure: list[BaseException]) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=SOCKET_TIMEOUT_S) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            block = memoryview(bytes(SOCKET_BUFFER))
            while go.wait(SOCKET_TIMEOUT_S) and not done.is_set():
                go.clear()
                left = nbytes
                while left > 0:
                    left -= sock.send(block[:min(left, len(block))])
    except OSError as exc:  # the receiver closed first, or a timeout: it reports the failure
        failure.append(exc)


def filesystem_type(path: str) -> str:
    """The type (ext4, xfs, tmpfs, ...) of the mount holding `path`, from /proc/mounts."""
    path, best, kind = os.path.realpath(path), "", "unknown"
    try:
        with open("/proc/mounts", encoding="utf-8") as fh:
            for line in fh:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].encode().decode("unicode_escape")  # \040 for spaces
                inside = path == mount or path.startswith(mount.rstrip("/") + "/")
                if inside and len(mount) > len(best):
                    best, kind = mount, fields[2]
    except OSError:
        pass
    return kind
