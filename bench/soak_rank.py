"""The soak's rank actor: a Rank whose L3 client and directory client can be told to fail.

`kvtier bench soak` on the actor system runs its instances with `rank_class=SoakRank`.
The storage client is wrapped in `FaultyBackend` (errors, delays, partial writes, torn reads,
hangs) and the directory client in `FlakyDirectory` (lookups that fail on this rank only), so
faults are armed per rank, between steps, through `Instance.on_rank`, and every fault that
met a call is counted (`faults_fired`), so a test can tell a fault that fired from one that
was armed and never reached.
"""
from __future__ import annotations

import logging
from typing import Sequence

from kvtier.actors.rank_actor import Rank
from kvtier.backends.base import StorageBackend, StorageUnavailable
from kvtier.backends.faulty import FaultKind, FaultyBackend, StorageOp
from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceInfo
from kvtier.tiers.storage_types import PageDirectoryClient

log = logging.getLogger(__name__)


class FlakyDirectory:
    """A page-directory client whose next `fail_lookups` lookups fail on this rank only."""

    def __init__(self, inner: PageDirectoryClient) -> None:
        self.inner = inner
        self.fail_lookups = 0
        self.injected = 0  # lookups failed so far

    def lookup(self, ns: str, hashes: Sequence[str], lease_ttl_s: float = 0.0):
        if self.fail_lookups > 0:
            self.fail_lookups -= 1
            self.injected += 1
            raise StorageUnavailable("injected: this rank's directory lookup failed")
        return self.inner.lookup(ns, hashes, lease_ttl_s)

    def __getattr__(self, name: str):  # report_stored, release, report_missing, ...
        return getattr(self.inner, name)


class SoakRank(Rank):
    """Rank with per-rank L3 and directory faults on request."""

    _faulty: FaultyBackend | None = None
    _flaky: FlakyDirectory | None = None
    _reported_hits = 0

    def _open_backend(self, info: NamespaceInfo, heads: HeadRange) -> StorageBackend:
        self._faulty = FaultyBackend(super()._open_backend(info, heads), seed=self.rank)
        return self._faulty

    def _directory(self, l3_actor: str) -> PageDirectoryClient:
        self._flaky = FlakyDirectory(super()._directory(l3_actor))
        return self._flaky

    def inject(self, op: str, kind: str, times: int = 1, delay_s: float = 0.3) -> bool:
        """Fault the next `times` calls of the L3 client's `op`; False without an L3."""
        if self._faulty is None:
            return False
        self._faulty.inject(StorageOp(op), FaultKind(kind), times=times, delay_s=delay_s)
        return True

    def fail_lookups(self, times: int = 1) -> bool:
        """Make this rank's next `times` directory lookups fail (the others' work)."""
        if self._flaky is None:
            return False
        self._flaky.fail_lookups += times
        return True

    def release_hangs(self) -> None:
        """Let hung L3 calls return (with an error) and disarm what is still armed."""
        if self._faulty is not None:
            self._faulty.clear()
        if self._flaky is not None:
            self._flaky.fail_lookups = 0

    def faults_fired(self) -> dict[str, int]:
        """Calls that met an armed fault in this rank process, by fault: the L3 client's as
        `FaultyBackend` names them ("get:hang", ...), "lookup" for failed directory lookups."""
        fired = dict(self._faulty.faults.injected) if self._faulty is not None else {}
        if self._flaky is not None:
            fired["lookup"] = self._flaky.injected
        return fired

    def take_faults_hit(self) -> int:
        """Calls that met an armed fault since the last call (this rank process only)."""
        total = sum(self.faults_fired().values())
        new, self._reported_hits = total - self._reported_hits, total
        return new
