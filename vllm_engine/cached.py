"""What KvtierConnector tells the engine's driver about one request (vllm_engine/instance.py):
the prompt tokens it supplied, by tier, in the `kv_transfer_params` of the request's last
output. A module of its own: the connector imports it in vLLM's EngineCore process."""
from __future__ import annotations

from typing import Any, NamedTuple


class CachedBySource(NamedTuple):
    """The prompt tokens KvtierConnector supplied to one request, by where it read them: the
    `kv_transfer_params` of the request's last output (its `request_finished` returns them)."""

    host: int  # loaded from L2
    storage: int  # read from L3 into L2 for the request, then loaded
    peer: int = 0  # read from another instance's L2 into L2 for the request, then loaded

    PARAM = "kvtier_cached"  # the one key kvtier puts in a request's kv_transfer_params

    def to_params(self) -> dict[str, Any]:
        return {self.PARAM: [self.host, self.storage, self.peer]}

    @classmethod
    def of(cls, params: dict[str, Any] | None) -> "CachedBySource":
        """From an output's kv_transfer_params (none: the connector supplied nothing)."""
        if not params or cls.PARAM not in params:
            return cls(0, 0)
        return cls(*(int(n) for n in params[cls.PARAM]))
