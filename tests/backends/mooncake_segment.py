"""A Mooncake client in a child process that only mounts a segment: the "host" whose memory
holds the objects other clients put. Tests stop it (SIGSTOP) as a host whose link is cut, or
kill it.

    python mooncake_segment.py MASTER_ADDRESS SEGMENT_BYTES
    -> "SEGMENT READY <name>"   (mounted; it then waits for stdin to close)
"""
from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # before mooncake loads


class SegmentOwner:
    """The child process; `stop()`/`resume()` freeze and thaw it, `close()` ends it."""

    def __init__(self, master_address: str, segment_bytes: int = 64 << 20) -> None:
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), master_address,
                                      str(segment_bytes)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.pid, self.name, self.stopped = self.proc.pid, "", False

    @classmethod
    def start(cls, master_address: str, count: int = 1) -> list["SegmentOwner"]:
        """`count` owners, started side by side; returned once each has mounted."""
        owners = [cls(master_address) for _ in range(count)]
        try:
            for owner in owners:
                owner._ready()
        except BaseException:
            for owner in owners:
                owner.close()
            raise
        return owners

    def _ready(self) -> None:
        line = self.lines.get(timeout=120)
        assert line.startswith("READY"), f"the segment owner said {line!r}"
        self.name = line.split()[1]

    def _pump(self) -> None:
        for line in self.proc.stdout:
            if line.startswith("SEGMENT "):
                self.lines.put(line[8:].strip())
        self.lines.put("EOF")

    def stop(self) -> None:
        """SIGSTOP the segment's owner; returns once every thread of it is stopped."""
        from tests.backends.stopped import sigstop

        sigstop(self.pid)
        self.stopped = True

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def close(self) -> None:
        """End the process: a clean close, or a kill for one that was stopped (its client
        may have been dropped by the master meanwhile: a clean close would wait on it)."""
        if self.proc.poll() is None:
            self.resume()
            if self.stopped:
                self.proc.kill()
            else:
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def main() -> None:
    from mooncake.store import MooncakeDistributedStore

    from kvtier.backends.mooncake_master import free_port

    store = MooncakeDistributedStore()
    name = f"127.0.0.1:{free_port()}"
    rc = store.setup(name, "P2PHANDSHAKE", int(sys.argv[2]), 0, "tcp", "", sys.argv[1])
    print(f"SEGMENT {'READY' if rc == 0 else 'FAILED'} {store.get_hostname()}", flush=True)
    sys.stdin.read()  # until the test closes our stdin
    time.sleep(0.1)
    store.close()


if __name__ == "__main__":
    main()
