"""The two ceilings a cross-host L3 benchmark reports next to kvtier's own L3 read rate,
measured between harness hosts (kvtier.hosts.network):

  * `tcp_gbps`: one plain TCP stream, sender host -> receiver host (4 MiB `sendall`s into a
    preallocated `recv_into` buffer), timed on the receiver from its first byte to its last;
  * `mooncake_read_gbps`: raw Mooncake Store reads (`batch_get_into` into a registered
    buffer) of objects that live in another host's segment: a master in one host, a writer
    client holding the only segment in a second, reader clients with no segment in a third.

Each process runs inside its host as a subcommand of this module (`tcp-recv`, `tcp-send`,
`master`, `mc-write`, `mc-read`), bound to the host's address, talks to the driver in lines
on stdin/stdout and ends when its stdin closes. Every wait is bounded. GB/s = 1e9 B/s.
CLI: `python -m kvtier.bench.host_ceilings --hosts 3 --json`.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Callable, NamedTuple, Sequence

import numpy as np

from kvtier.bench import emit
from kvtier.errors import KvtierError
from kvtier.hosts.network import Host, host_network

MODULE = "kvtier.bench.host_ceilings"
MiB = 1 << 20
CHUNK_BYTES = 4 * MiB
TCP_BYTES = 512 * MiB
TIMEOUT_S = 60.0  # any one wait: a socket operation, or a line from a child process
STOP_TIMEOUT_S = 10.0
ROUNDS = 3  # timed read rounds after one warm-up round; the best one counts
SEGMENT_FILL = 0.8  # Mooncake puts past ~90% of a segment fail with -200
# What one SmolLM2-135M bf16 TP=3 instance reads on a 2,048-token L3 hit: 32 pages x 3 ranks
# x k/v parts, each 30 layers x 1 KV head x 64 dims x 64 tokens x 2 bytes.
SMOL_OBJECTS, SMOL_OBJECT_BYTES = 192, 245_760


class CeilingError(KvtierError, RuntimeError):
    """A ceiling could not be measured: a process failed, a call returned an error code."""


class MooncakeCeiling(NamedTuple):
    gbps: float  # bytes / seconds / 1e9
    bytes: int  # every object once: what the readers read together in one round
    seconds: float  # best round: latest reader end - earliest reader start (wall clock)
    objects: int
    object_bytes: int


# ---- the driver side -----------------------------------------------------------------------
class _Child:
    """One subcommand of this module inside a host: its stdout lines, its stdin, its stderr."""

    def __init__(self, host: Host, role: str, *args: object) -> None:
        self.what = f"{role} in {host.name} ({host.address})"
        self.err = tempfile.TemporaryFile()
        self.proc = host.popen([sys.executable, "-m", MODULE, role, *map(str, args)],
                               env={"MC_LOG_LEVEL": os.environ.get("MC_LOG_LEVEL", "WARNING")},
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err,
                               text=True, bufsize=1)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def line(self, want: str | None = None) -> str:
        """The next line it prints (CeilingError, with its stderr, unless it is `want`)."""
        try:
            got = self.lines.get(timeout=TIMEOUT_S)
        except queue.Empty:
            got = None
        if got is None or want not in (None, got):
            self.err.seek(0)
            tail = self.err.read().decode(errors="replace")[-3000:].rstrip() or "(empty)"
            state = (f"said {got!r}, not {want!r}" if got is not None else
                     f"exited with code {self.proc.returncode}" if self.proc.poll() is not None
                     else f"said nothing within {TIMEOUT_S:.0f} s")
            raise CeilingError(f"{self.what} {state}; its stderr:\n{tail}")
        return got

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def hang_up(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()

    def __enter__(self) -> "_Child":
        return self

    def __exit__(self, *exc: object) -> None:
        """Hang up, wait; past STOP_TIMEOUT_S kill its session (a master's binary too)."""
        self.hang_up()
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(STOP_TIMEOUT_S)
        self.err.close()


def tcp_gbps(sender: Host, receiver: Host, nbytes: int = TCP_BYTES) -> float:
    """GB/s of one TCP stream of `nbytes` from `sender` to `receiver` (host addresses)."""
    if nbytes < 2 * CHUNK_BYTES:
        raise CeilingError(f"tcp_gbps needs nbytes >= {2 * CHUNK_BYTES}, got {nbytes}")
    with _Child(receiver, "tcp-recv", receiver.address, nbytes) as recv:
        port = recv.line()
        with _Child(sender, "tcp-send", sender.address, receiver.address, port, nbytes) as send:
            send.line("sent")
        got = json.loads(recv.line())
    return got["bytes"] / got["seconds"] / 1e9


def mooncake_read_gbps(master_host: Host, writer: Host, reader: Host, object_bytes: int,
                       objects: int, readers: int = 1,
                       probe: Callable[[], object] | None = None) -> MooncakeCeiling:
    """Aggregate GB/s of `readers` clients in `reader`, each reading its share of `objects`
    objects of `object_bytes` from the segment of a client in `writer`, against a master in
    `master_host`. Readers verify every byte. `probe()` runs once while every process still
    runs (tests look at listeners with it)."""
    if not 1 <= readers <= objects or object_bytes < 1:
        raise CeilingError(f"need 1 <= readers <= objects and object_bytes >= 1, got readers="
                           f"{readers}, objects={objects}, object_bytes={object_bytes}")
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(_Child(master_host, "master", master_host.address))
        address = master.line()
        put = stack.enter_context(_Child(writer, "mc-write", address, writer.address,
                                         object_bytes, 0, objects))
        put.line("ready")
        clients = [stack.enter_context(_Child(reader, "mc-read", address, reader.address,
                                              object_bytes, objects * r // readers,
                                              objects * (r + 1) // readers))
                   for r in range(readers)]
        for client in clients:
            client.line("ready")
        best = float("inf")
        for _ in range(ROUNDS):
            for client in clients:
                client.send("go")
            spans = [json.loads(client.line()) for client in clients]
            best = min(best, max(s["end"] for s in spans) - min(s["start"] for s in spans))
        if probe is not None:
            probe()
        for client in (*clients, put):  # clients close together (~1 s each), then the master
            client.hang_up()
    total = objects * object_bytes
    return MooncakeCeiling(total / best / 1e9, total, best, objects, object_bytes)


# ---- the processes inside the hosts --------------------------------------------------------
def _tcp_recv(address: str, nbytes: str) -> None:
    buf = memoryview(np.ones(int(nbytes), np.uint8))  # touched: no page faults while timed
    with socket.create_server((address, 0)) as server:
        server.settimeout(TIMEOUT_S)
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(TIMEOUT_S)
        first = got = conn.recv_into(buf)
        start = time.perf_counter()
        while got < len(buf):
            n = conn.recv_into(buf[got:])
            if not n:
                raise CeilingError(f"the sender closed after {got} of {len(buf)} bytes")
            got += n
        seconds = time.perf_counter() - start
    print(json.dumps({"bytes": got - first, "seconds": seconds}), flush=True)


def _tcp_send(address: str, peer: str, port: str, nbytes: str) -> None:
    chunk, left = memoryview(np.ones(CHUNK_BYTES, np.uint8)), int(nbytes)
    with socket.create_connection((peer, int(port)), TIMEOUT_S, (address, 0)) as conn:
        while left:
            conn.sendall(chunk[:min(left, CHUNK_BYTES)])
            left -= min(left, CHUNK_BYTES)
    print("sent", flush=True)


def _master(address: str) -> None:
    from kvtier.backends.mooncake_master import MooncakeMaster
    with MooncakeMaster(host=address) as master:
        print(master.address, flush=True)
        sys.stdin.read()


def _pattern(first: int, end: int, object_bytes: int) -> np.ndarray:
    """Objects first..end-1 back to back; object i's byte j is (31 j + 7919 i) mod 251."""
    j = np.arange(object_bytes, dtype=np.int64)
    return np.concatenate([((31 * j + 7919 * i) % 251).astype(np.uint8)
                           for i in range(first, end)])


def _check(call: str, rcs: Sequence[int], want: Sequence[int]) -> None:
    bad = [rc for rc, w in zip(rcs, want) if rc != w]
    if bad or len(rcs) != len(want):
        first = f"code {bad[0]}" if bad else f"{len(rcs)} results for {len(want)} objects"
        raise CeilingError(f"{call}: {len(bad)} of {len(want)} failed, first {first} (Mooncake "
                           "ErrorCode, types.h; kvtier.backends.mooncake_backend.describe names "
                           "the common ones)")


def _client(master: str, address: str, size: int, first: int, end: int,
            segment_bytes: int) -> tuple:
    """A client with a segment of `segment_bytes` and a registered buffer for objects
    first..end-1: (store, buffer, keys, pointers). Mooncake is called directly, not through
    kvtier.backends, whose import brings torch: seconds of CPU per process."""
    from mooncake.store import MooncakeDistributedStore
    with socket.create_server((address, 0)) as free:  # a free port: one setup attempt
        name = f"{address}:{free.getsockname()[1]}"
    store = MooncakeDistributedStore()
    _check(f"setup of client {name} against master {master} (is it running there?)",
           [store.setup(name, "P2PHANDSHAKE", segment_bytes, 0, "tcp", "", master)], [0])
    buf = np.zeros(size * (end - first), np.uint8)
    _check(f"register_buffer of {buf.nbytes} bytes",
           [store.register_buffer(buf.ctypes.data, buf.nbytes)], [0])
    return (store, buf, [f"host-ceiling/{i}" for i in range(first, end)],
            [buf.ctypes.data + k * size for k in range(end - first)])


def _mc_write(master: str, address: str, object_bytes: str, first: str, end: str) -> None:
    size, first_i, end_i = int(object_bytes), int(first), int(end)
    segment = -(-int(size * (end_i - first_i) / SEGMENT_FILL) // MiB) * MiB + 16 * MiB
    store, buf, keys, ptrs = _client(master, address, size, first_i, end_i, segment)
    buf[:] = _pattern(first_i, end_i, size)
    _check("batch_put_from", store.batch_put_from(keys, ptrs, [size] * len(keys)),
           [0] * len(keys))
    print("ready", flush=True)
    sys.stdin.read()  # the objects live in this client's segment: keep it mounted
    store.close()


def _mc_read(master: str, address: str, object_bytes: str, first: str, end: str) -> None:
    size, first_i, end_i = int(object_bytes), int(first), int(end)
    # no segment: nothing is placed on this host
    store, buf, keys, ptrs = _client(master, address, size, first_i, end_i, 0)
    expected, sizes = _pattern(first_i, end_i, size), [size] * len(keys)

    def one_round() -> dict:
        buf.fill(0)
        start = time.time()  # wall clock: rounds are compared across reader processes
        rcs = store.batch_get_into(keys, ptrs, sizes)
        end_s = time.time()
        _check("batch_get_into", rcs, sizes)
        if not np.array_equal(buf, expected):
            raise CeilingError(f"objects {first}..{end_i - 1} read back differ from the "
                               "pattern written")
        return {"start": start, "end": end_s}

    one_round()  # warm-up: connections, the buffer's pages
    print("ready", flush=True)
    for _ in sys.stdin:  # one "go" a round
        print(json.dumps(one_round()), flush=True)
    store.close()


ROLES = {"tcp-recv": _tcp_recv, "tcp-send": _tcp_send, "master": _master,
         "mc-write": _mc_write, "mc-read": _mc_read}


def measure(hosts: int = 3, tcp_bytes: int = TCP_BYTES, objects: int = SMOL_OBJECTS,
            object_bytes: int = SMOL_OBJECT_BYTES, readers: int = 3) -> dict:
    """Both ceilings on a fresh network: host 1 the master, host 2 the writer and TCP
    sender, host 3 the readers and TCP receiver."""
    if hosts < 3:
        raise CeilingError(f"the ceilings need 3 hosts (master, writer, reader), got {hosts}")
    with host_network(hosts) as net:
        master, writer, reader = net.hosts[:3]
        tcp = tcp_gbps(writer, reader, tcp_bytes)
        mc = mooncake_read_gbps(master, writer, reader, object_bytes, objects, readers)
    return {"raw_tcp_gbps": round(tcp, 3), "raw_mooncake_read_gbps": round(mc.gbps, 3),
            "tcp_bytes": tcp_bytes, "mooncake_read_bytes": mc.bytes,
            "mooncake_read_seconds": round(mc.seconds, 6), "objects": objects,
            "object_bytes": object_bytes, "readers": readers}


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ROLES:  # a process inside a host
        ROLES[argv[0]](*argv[1:])
        return
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    p.add_argument("--hosts", type=int, default=3, help="hosts to create (3 are used)")
    p.add_argument("--json", action="store_true", help="one JSON line")
    a = p.parse_args(argv)
    emit(measure(a.hosts), a.json)


if __name__ == "__main__":
    main()
