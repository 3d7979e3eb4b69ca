"""What KvtierConnector's workers copied, summed over steps and ranks (`CopyStats`): vLLM
carries a worker's figures to its front end every step as a `KVConnectorStats` payload (a
dict, built and read only through `CopyStats`). Two readers: vLLM's Prometheus registry
(kvtier.connector.stats) and the engine's driver in the serve graph, which counts them into
kvtier's own metrics (vllm_engine/instance.py). Tokens are rank 0's only (every rank copies the
same pages: its own heads), bytes and seconds every rank's; the scheduler side adds its count
of requests it could not key."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class CopyStats:
    hit_tokens: int = 0  # loaded into vLLM's blocks from pages L2 held (rank 0)
    l3_hit_tokens: int = 0  # loaded from pages read from L3 for the request (rank 0)
    peer_hit_tokens: int = 0  # loaded from pages read from a peer's L2 for it (rank 0)
    backup_tokens: int = 0  # saved from vLLM's blocks into L2 (rank 0)
    failed_load_tokens: int = 0  # loads that failed and were recomputed (rank 0)
    load_back_bytes: int = 0
    load_back_seconds: float = 0.0
    backup_bytes: int = 0
    backup_seconds: float = 0.0
    # the scheduler side's: requests whose pages could not be keyed (neither loaded nor saved)
    unkeyed_adapter_requests: int = 0  # a LoRA adapter whose files it cannot read
    unkeyed_multimodal_requests: int = 0  # a multimodal item without an identifier

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
