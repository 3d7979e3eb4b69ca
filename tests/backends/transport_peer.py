"""The decode side of the handoff tests: an endpoint with a registered pool, in this process
(InProcessPeer) or in a child process (ProcessPeer, which runs this file as a script).

    python transport_peer.py KIND NBYTES
    -> "PEER READY <pid> <address as hex>"   (pool registered, filled with `pattern(NBYTES)`)
    <- "dump PATH OFFSET NBYTES" -> "PEER OK": those bytes of the pool written to PATH
    <- "close"        -> "PEER OK": the endpoint closed, the process (and pool) stay
    <- "exit"         -> the process ends

Replies start with "PEER " because the libraries write their own lines to stdout.
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading

import numpy as np
import torch

from kvtier.backends import transport_address
from kvtier.backends.transport_registry import open_endpoint


def pattern(nbytes: int) -> np.ndarray:
    """The destination pool's bytes before any write (both processes compute them)."""
    return np.resize((np.arange(251, dtype=np.uint16) * 7 % 251).astype(np.uint8), nbytes)


class InProcessPeer:
    """A decode endpoint in this process (the simulated transport, or two-in-one checks)."""

    def __init__(self, kind: str, nbytes: int, read_bytes: int):
        self.pool = torch.from_numpy(pattern(nbytes).copy())
        self.endpoint = open_endpoint(kind, "decode-local")
        self.endpoint.register(self.pool.data_ptr(), self.pool.nbytes)
        self.address, self.base, self.pid = self.endpoint.address(), self.pool.data_ptr(), None
        self.read_bytes = read_bytes

    def read(self, offset: int = 0, nbytes: int = 0) -> np.ndarray:
        return self.pool.numpy()[offset:offset + (nbytes or self.read_bytes)].copy()

    def close_endpoint(self) -> None:
        self.endpoint.close()

    def shutdown(self) -> None:
        self.endpoint.close()


class ProcessPeer:
    """A decode endpoint in a child process running this file."""

    def __init__(self, kind: str, nbytes: int, read_bytes: int):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), kind,
                                      str(nbytes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        _, pid, hexaddr = self.reply("READY").split()
        self.pid, self.address = int(pid), bytes.fromhex(hexaddr)
        self.base = transport_address.decode(self.address).regions[0].addr
        self.read_bytes = read_bytes

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("PEER "):
                self.lines.put(line[5:].strip())
        self.lines.put("EOF")

    def reply(self, tag: str, timeout_s: float = 120.0) -> str:
        line = self.lines.get(timeout=timeout_s)
        assert line.startswith(tag), f"peer said {line!r}, expected {tag}"
        return line

    def command(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        self.reply("OK")

    def read(self, offset: int = 0, nbytes: int = 0) -> np.ndarray:
        with tempfile.NamedTemporaryFile(suffix=".bin") as f:
            self.command(f"dump {f.name} {offset} {nbytes or self.read_bytes}")
            return np.fromfile(f.name, dtype=np.uint8)

    def close_endpoint(self) -> None:
        self.command("close")

    def stop(self) -> None:
        """SIGSTOP the process; returns once every thread of it is stopped."""
        from stopped import sigstop  # tests/backends is on the path of its importers

        sigstop(self.pid)

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGCONT)
            try:
                self.proc.stdin.write("exit\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=10)


def main() -> None:
    kind, nbytes = sys.argv[1], int(sys.argv[2])
    pool = torch.from_numpy(pattern(nbytes).copy())
    endpoint = open_endpoint(kind, "decode-peer")
    endpoint.register(pool.data_ptr(), pool.nbytes)

    def say(text: str) -> None:
        sys.stdout.write(f"PEER {text}\n")
        sys.stdout.flush()

    say(f"READY {os.getpid()} {endpoint.address().hex()}")
    for _ in range(10_000):  # bounded: a test sends a handful of commands
        line = sys.stdin.readline()
        if not line:
            break
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "dump":
            path, offset, size = arg.split()
            pool.numpy()[int(offset):int(offset) + int(size)].tofile(path)
            say("OK")
        elif cmd == "close":
            endpoint.close()
            say("OK")
        elif cmd == "exit":
            break
    endpoint.close()


if __name__ == "__main__":
    main()
