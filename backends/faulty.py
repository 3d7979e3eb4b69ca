"""A fault-injecting wrapper around any L3 backend: errors, delays, partial writes, torn reads
and hangs, on a schedule or at random, counted.

Why a wrapper and not a flag in each backend: the faults a cache must survive are the same
whatever stores the pages, and the real backend underneath still does the real work, so a
test sees exactly what it would in production once the storage misbehaves.

    faulty = FaultyBackend(create_backend("file", target, {"root_dir": d}))
    faulty.inject(StorageOp.GET, FaultKind.HANG, times=1)     # the next read hangs
    ... the cache's prefetch times out, the request is recomputed ...
    faulty.release()                                          # let the hung call go

A fault drill in other processes (`kvtier bench chaos`, whose ranks run inside vLLM's
workers) writes the rules to a file instead (`write_fault_file`); each rank's client follows
it when its storage options name it (`fault_file`: tiers/page_store.open_rank_backend), and
appends one line to `<file>.hits` per call it faulted (`fault_hits`).
"""
from __future__ import annotations

import enum
import json
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from kvtier.backends.base import (PoolRegistration, StorageBackend, StorageUnavailable,
                                  TransferResult)

log = logging.getLogger(__name__)

MAX_HANG_S = 120.0  # a hang ends by itself at the latest after this (no test waits forever)


class StorageOp(enum.Enum):
    EXISTS = "exists"
    GET = "get"
    SET = "set"
    DELETE = "delete"


class FaultKind(enum.Enum):
    ERROR = "error"  # the call raises StorageUnavailable
    DELAY = "delay"  # the call sleeps `delay_s`, then works
    PARTIAL = "partial"  # a batch does only its first half (the rest: ok False)
    TORN = "torn"  # a read moves the bytes but a page of it fails verification (ok False)
    HANG = "hang"  # the call blocks until `release()` (or MAX_HANG_S), then fails


@dataclass
class _Rule:
    op: StorageOp
    kind: FaultKind
    times: int  # calls left to hit (-1: every call)
    probability: float = 1.0
    delay_s: float = 0.0


class FileRule(NamedTuple):
    """A rule of a fault file: every `op` call of the clients whose KV heads start at
    `first_head` (None: every client; a TP rank's first head names the rank) is faulted with
    `kind` (not HANG: nobody could release it), each with `probability`."""

    op: StorageOp
    kind: FaultKind
    delay_s: float = 0.0
    first_head: int | None = None
    probability: float = 1.0

    def to_dict(self) -> dict:
        return {**self._asdict(), "op": self.op.value, "kind": self.kind.value}

    @classmethod
    def from_dict(cls, d: dict) -> "FileRule":
        rule = cls(StorageOp(d["op"]), FaultKind(d["kind"]), float(d.get("delay_s", 0.0)),
                   d.get("first_head"), float(d.get("probability", 1.0)))
        if rule.kind is FaultKind.HANG or not 0.0 <= rule.delay_s <= MAX_HANG_S:
            raise ValueError(f"a fault file cannot ask for {rule.kind.value} with delay_s "
                             f"{rule.delay_s} (hangs are for tests in one process; delays up "
                             f"to {MAX_HANG_S:.0f} s)")
        return rule


def write_fault_file(path: str, rules: Sequence[FileRule]) -> None:
    """Replace the rules of the fault file at `path` at once (no client reads half a file)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump([r.to_dict() for r in rules], f)
    os.replace(tmp, path)


def fault_hits(path: str) -> int:
    """Calls faulted by the rules of the fault file at `path` so far, in every process."""
    try:
        with open(f"{path}.hits", "rb") as f:
            return f.read().count(b"\n")
    except FileNotFoundError:
        return 0


@dataclass
class FaultCounters:
    injected: dict[str, int] = field(default_factory=dict)  # "op:kind" -> calls hit

    @property
    def total(self) -> int:
        return sum(self.injected.values())


class FaultyBackend(StorageBackend):
    """`inner` with faults: `inject(op, kind, ...)` adds a rule; the first matching rule of a
    call decides its fault, then those of `rules_file` (a fault file, read again whenever it
    changes). Thread-safe (the storage worker calls from its own thread)."""

    def __init__(self, inner: StorageBackend, seed: int = 0, rules_file: str = "") -> None:
        super().__init__(inner.target)
        self.inner = inner
        self.kind = inner.kind
        self.capabilities = inner.capabilities
        self.faults = FaultCounters()
        self._rules: list[_Rule] = []
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._rng = random.Random(seed)
        self._rules_file = rules_file
        self._file_version: tuple | None = None  # (inode, mtime, size) of the rules read
        self._file_rules: list[_Rule] = []

    # ---- the schedule -------------------------------------------------------------------------
    def inject(self, op: StorageOp, kind: FaultKind, times: int = 1, probability: float = 1.0,
               delay_s: float = 0.0) -> None:
        """Fault the next `times` calls of `op` (-1: all of them), each with `probability`."""
        if times == 0 or times < -1:
            raise ValueError(f"times must be >= 1 or -1 (every call), got {times}")
        with self._lock:
            self._rules.append(_Rule(op, kind, times, probability, delay_s))
            if kind is FaultKind.HANG:
                self._release.clear()

    def clear(self) -> None:
        """No more faults; hung calls are released."""
        with self._lock:
            self._rules.clear()
        self.release()

    def release(self) -> None:
        """Let every hung call return (with an error)."""
        self._release.set()

    def _fault(self, op: StorageOp) -> _Rule | None:
        with self._lock:
            self._follow_file()
            for rule in (*self._rules, *self._file_rules):
                if rule.op is not op or rule.times == 0:
                    continue
                if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                    continue
                if rule.times > 0:
                    rule.times -= 1
                key = f"{op.value}:{rule.kind.value}"
                self.faults.injected[key] = self.faults.injected.get(key, 0) + 1
                if any(rule is r for r in self._file_rules):
                    self._note_hit(key)
                return rule
        return None

    def _follow_file(self) -> None:
        """The fault file's rules for this client, read again when the file changed (one
        stat per call); none while it is missing or unreadable."""
        if not self._rules_file:
            return
        try:
            st = os.stat(self._rules_file)
        except OSError:
            self._file_version, self._file_rules = None, []
            return
        version = (st.st_ino, st.st_mtime_ns, st.st_size)
        if version == self._file_version:
            return
        self._file_version, self._file_rules = version, []
        heads = self.target.heads
        try:
            with open(self._rules_file) as f:
                rules = [FileRule.from_dict(d) for d in json.load(f)]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("fault file %s: unreadable (%s); no faults from it", self._rules_file,
                        exc)
            return
        self._file_rules = [_Rule(r.op, r.kind, -1, r.probability, r.delay_s) for r in rules
                            if r.first_head is None
                            or heads.start == r.first_head]

    def _note_hit(self, key: str) -> None:
        try:
            with open(f"{self._rules_file}.hits", "a") as f:
                f.write(f"{key}\n")
        except OSError as exc:
            log.warning("fault file %s: cannot count a hit (%s)", self._rules_file, exc)

    def _before(self, op: StorageOp) -> _Rule | None:
        """Apply the call-level faults (error, delay, hang); the batch-level ones come back."""
        rule = self._fault(op)
        if rule is None:
            return None
        log.warning("injecting %s into %s of the %s backend", rule.kind.value, op.value,
                    self.kind)
        if rule.kind is FaultKind.ERROR:
            raise StorageUnavailable(f"injected: {op.value} failed")
        if rule.kind is FaultKind.DELAY:
            time.sleep(rule.delay_s)
            return None
        if rule.kind is FaultKind.HANG:
            self._release.wait(MAX_HANG_S)
            raise StorageUnavailable(f"injected: {op.value} hung, then failed")
        return rule

    # ---- the backend interface, through `inner` -----------------------------------------------
    def _register(self, reg: PoolRegistration) -> None:
        self.inner.register_pool(reg.name, reg.pool, reg.num_parts, reg.hit_policy,
                                 reg.window_pages)

    def _present(self, reg: PoolRegistration, keys: list[str]) -> list[bool]:
        self._before(StorageOp.EXISTS)
        n = self.inner.exists(keys, (reg.name,)).usable_pages
        return [i < n for i in range(len(keys))]

    def _get(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]
             ) -> TransferResult:
        rule = self._before(StorageOp.GET)
        if rule is not None and rule.kind is FaultKind.PARTIAL:
            return self._first_half(self.inner.get_into, reg, keys, host_pages)
        result = self.inner.get_into(reg.name, keys, host_pages)
        if rule is not None and rule.kind is FaultKind.TORN and result.ok:
            bad = self._rng.randrange(len(result.ok))  # one page fails its check
            ok = list(result.ok)
            ok[bad] = False
            return TransferResult(ok, result.bytes_moved)
        return result

    def _set(self, reg: PoolRegistration, keys: list[str], host_pages: list[int]
             ) -> TransferResult:
        rule = self._before(StorageOp.SET)
        if rule is not None and rule.kind in (FaultKind.PARTIAL, FaultKind.TORN):
            return self._first_half(self.inner.set_from, reg, keys, host_pages)
        return self.inner.set_from(reg.name, keys, host_pages)

    @staticmethod
    def _first_half(transfer, reg: PoolRegistration, keys: list[str], host_pages: list[int]
                    ) -> TransferResult:
        """Move only the first half of the batch; the rest did not move (ok False)."""
        half = len(keys) // 2
        result = transfer(reg.name, keys[:half], host_pages[:half])
        return TransferResult(list(result.ok) + [False] * (len(keys) - half),
                              result.bytes_moved)

    def _delete(self, reg: PoolRegistration, keys: list[str]) -> int:
        self._before(StorageOp.DELETE)
        return self.inner.delete(keys, (reg.name,))

    def _list_pages(self, pool: str, num_parts: int) -> dict[str, set[int]]:
        return self.inner.list_pages(pool)

    def _reclaim_old_format(self, pool: str) -> int:
        return self.inner.reclaim_old_format(pool)

    def _close(self) -> None:
        self.release()
        self.inner.close()
