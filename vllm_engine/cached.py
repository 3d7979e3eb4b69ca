"""What KvtierConnector tells the engine's driver about one request (vllm_engine/instance.py):
the prompt tokens it supplied, by tier, in the `kv_transfer_params` of the request's last
output. A module of its own: the connector imports it in vLLM's EngineCore process."""
from __future__ import annotations

from typing import Any, NamedTuple


class CachedBySource(NamedTuple):
    """The prompt tokens KvtierConnector supplied to one request, by where it read them: the
    `kv_transfer_params` of the request's last output (its `request_finished` returns them).
    vLLM counts every token it planned to take from the connector as cached; `failed` are
    those whose load failed, which vLLM computed again (`loaded` says what really loaded)."""

    host: int  # planned from L2
    storage: int  # read from L3 into L2 for the request, then planned
    peer: int = 0  # read from another instance's L2 into L2 for the request, then planned
    failed: int = 0  # of those: the load failed, vLLM recomputed them

    PARAM = "kvtier_cached"  # the one key kvtier puts in a request's kv_transfer_params

    @property
    def planned(self) -> int:
        """Tokens vLLM took from the connector (and counts as cached)."""
        return self.host + self.storage + self.peer

    def loaded(self) -> "CachedBySource":
        """What really loaded: the failed tokens taken off host, then storage, then peer."""
        left, tiers = self.failed, []
        for n in (self.host, self.storage, self.peer):
            cut = min(n, left)
            tiers.append(n - cut)
            left -= cut
        return CachedBySource(*tiers)

    def to_params(self) -> dict[str, Any]:
        return {self.PARAM: [self.host, self.storage, self.peer, self.failed]}

    @classmethod
    def of(cls, params: dict[str, Any] | None) -> "CachedBySource":
        """From an output's kv_transfer_params (none: the connector supplied nothing)."""
        if not params or cls.PARAM not in params:
            return cls(0, 0)
        return cls(*(int(n) for n in params[cls.PARAM]))
