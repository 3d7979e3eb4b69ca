"""What the connector's workers moved, as kvtier's metric families under vLLM.

Each worker counts its copies between vLLM's blocks and its host pool (`CopyStats`); vLLM
carries them to its front end every step (as a `KVConnectorStats` payload: a dict, built
and read here only through `CopyStats`), sums them over the ranks and steps, and records
them in its Prometheus registry under kvtier's family names after vLLM's `vllm:` prefix
(`FAMILIES`; vLLM's `LLM.get_metrics` reads only that prefix). Tokens are rank 0's only (every
rank copies the same pages: its own heads), bytes and seconds every rank's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class CopyStats:
    hit_tokens: int = 0  # loaded into vLLM's blocks from pages L2 held (rank 0)
    l3_hit_tokens: int = 0  # loaded from pages read from L3 for the request (rank 0)
    backup_tokens: int = 0  # saved from vLLM's blocks into L2 (rank 0)
    failed_load_tokens: int = 0  # loads that failed and were recomputed (rank 0)
    load_back_bytes: int = 0
    load_back_seconds: float = 0.0
    backup_bytes: int = 0
    backup_seconds: float = 0.0

    def __add__(self, other: "CopyStats") -> "CopyStats":
        return CopyStats(*(getattr(self, f.name) + getattr(other, f.name)
                           for f in dataclasses.fields(self)))

    @property
    def empty(self) -> bool:
        return self == CopyStats()

    def to_payload(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_payload(cls, data: Mapping[str, Any] | None) -> "CopyStats":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data or {}) - names
        if unknown:
            raise ConfigError(f"kvtier connector stats with unknown fields {sorted(unknown)}: "
                              f"the worker and the front end run different kvtier versions")
        return cls(**dict(data or {}))

    def gbps(self) -> tuple[float, float]:
        """(load, save) bandwidth in GB/s over the copies counted (0 when none)."""
        def rate(size: int, seconds: float) -> float:
            return size / seconds / 1e9 if seconds > 0 else 0.0

        return (rate(self.load_back_bytes, self.load_back_seconds),
                rate(self.backup_bytes, self.backup_seconds))


# Prometheus family (vLLM adds no _total suffix to a counter's name here; the exposition does), labels, CopyStats field, help
FAMILIES = (
    ("vllm:kvtier_hit_tokens", {"tier": "host"}, "hit_tokens",
     "Prompt tokens the connector loaded into vLLM's blocks, by tier"),
    ("vllm:kvtier_hit_tokens", {"tier": "storage"}, "l3_hit_tokens",
     "Prompt tokens the connector loaded into vLLM's blocks, by tier"),
    ("vllm:kvtier_backup_tokens", {}, "backup_tokens", "Tokens of full blocks saved into L2"),
    ("vllm:kvtier_load_failed_tokens", {}, "failed_load_tokens",
     "Tokens whose load failed; vLLM recomputed them"),
    ("vllm:kvtier_load_back_bytes", {}, "load_back_bytes", "Bytes copied from L2 into vLLM's blocks"),
    ("vllm:kvtier_load_back_seconds", {}, "load_back_seconds", "Seconds spent on those copies"),
    ("vllm:kvtier_backup_bytes", {}, "backup_bytes", "Bytes copied from vLLM's blocks into L2"),
    ("vllm:kvtier_backup_seconds", {}, "backup_seconds", "Seconds spent on those copies"),
)
_FIELDS = {f.name for f in dataclasses.fields(CopyStats)}
_MISSING = [field for _, _, field, _ in FAMILIES if field not in _FIELDS]
if _MISSING:  # a renamed field fails at import, not by a metric that stops moving
    raise ConfigError(f"metric families read CopyStats fields it lacks: {_MISSING}")
