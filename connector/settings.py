"""The connector's settings: vLLM's `kv_connector_extra_config`, read under SGLang's names.

SGLang's flags without their dashes (`hicache_ratio`, `hicache_size`, `hicache_write_policy`,
`hicache_storage_prefetch_policy`, `hicache_storage_backend`,
`hicache_storage_backend_extra_config`) set kvtier's `HiCacheConfig`, validated as for
`kvtier serve`; `ray_address` names the Ray cluster of the L3 namespace actor, `l3_actor`
that actor (kvtier's default name) and `l3_state_dir` where it keeps its registry when this
engine starts it (default: beside a file or nixl L3's pages, as `kvtier serve` keeps it, so
another L3 directory starts another registry). `peer_transport` (`nixl` or `mooncake`) turns
peer-to-peer L2 on: the engine reads the pages other engines of its namespace hold in their
host pools, and lends its own. See docs/vllm.md for what each does under vLLM.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Any, Mapping

from kvtier.config import CONNECTOR_FIELDS, CONNECTOR_PEER_KEY, GB, HiCacheConfig, connector_key
from kvtier.errors import ConfigError
from kvtier.policies import StorageBackendKind, Transport, WritePolicy

CONNECTOR = "KvtierConnector"
_KEYS = {connector_key(f): f for f in CONNECTOR_FIELDS}
RAY_ADDRESS = "ray_address"
L3_ACTOR = "l3_actor"
L3_STATE_DIR = "l3_state_dir"
STATE_DIR_NAME = ".kvtier-l3-state"  # beside a file or nixl L3's pages, as kvtier serve's
# With L3 off and peers on, engines find each other through the namespace actor's directory
# of a namespace registered as a file one (the actor opens a backend for every namespace)
# under `ConnectorSettings.directory_root`, which nothing writes: no worker attaches it.
DIRECTORY_BACKEND = StorageBackendKind.FILE
DIRECTORY_ROOT_NAME = "kvtier-peer-directory"
_OWN_KEYS = (RAY_ADDRESS, L3_ACTOR, L3_STATE_DIR, CONNECTOR_PEER_KEY)
_STRING_KEYS = (RAY_ADDRESS, L3_ACTOR, L3_STATE_DIR)


@dataclass(frozen=True)
class ConnectorSettings:
    cache: HiCacheConfig
    ray_address: str | None = None
    l3_actor: str | None = None  # None: the namespace actor's default name
    l3_state_dir: str | None = None  # where a namespace actor it starts keeps its registry
    peer: Transport | None = None  # peer-to-peer L2 over it (None: off)

    @property
    def l3(self) -> bool:
        return self.cache.storage_backend is not None

    @property
    def directory(self) -> bool:
        """Whether the engine uses the L3 namespace actor's directory (L3 or peers on)."""
        return self.l3 or self.peer is not None

    def directory_root(self) -> str:
        """L3 off, peers on: the root the namespace is registered on (the same for every
        engine of a host that gives no `l3_state_dir`; nothing is written there)."""
        return os.path.join(self.l3_state_dir or tempfile.gettempdir(), DIRECTORY_ROOT_NAME)

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "ConnectorSettings":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(_KEYS) - set(_OWN_KEYS))
        if unknown:
            raise ConfigError(f"{CONNECTOR}: unknown kv_connector_extra_config key(s) "
                              f"{', '.join(unknown)}; it takes "
                              f"{', '.join(sorted([*_KEYS, *_OWN_KEYS]))}")
        fields = {_KEYS[k]: v for k, v in extra.items() if k in _KEYS}
        if isinstance(fields.get("storage_options"), str):
            fields["storage_options"] = _json_object(fields["storage_options"])
        cache = HiCacheConfig.from_dict(fields).normalize()
        if cache.write_policy is WritePolicy.WRITE_BACK:
            raise ConfigError(f"{CONNECTOR}: hicache_write_policy {cache.write_policy.value} "
                              f"is not available under vLLM (vLLM does not tell a connector "
                              f"when it evicts a block); use write_through or "
                              f"write_through_selective")
        for key in _STRING_KEYS:
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise ConfigError(f"{CONNECTOR}: {key} must be a string (e.g. ray_address "
                                  f"'127.0.0.1:6379'), got {extra[key]!r}")
        state_dir = extra.get(L3_STATE_DIR)
        root = (cache.storage_options.to_dict().get("root_dir")
                if cache.storage_options is not None else None)
        if state_dir is None and isinstance(root, str):
            state_dir = os.path.join(root, STATE_DIR_NAME)
        peer = extra.get(CONNECTOR_PEER_KEY)
        peer = None if peer is None else Transport.parse_across(
            peer, f"{CONNECTOR}: {CONNECTOR_PEER_KEY}")
        return cls(cache, extra.get(RAY_ADDRESS), extra.get(L3_ACTOR), state_dir, peer)

    def host_slots(self, device_blocks: int, slot_bytes: int) -> int:
        """Host-pool slots per rank: `hicache_size` GB of `slot_bytes` pages, else
        `hicache_ratio` times vLLM's device blocks."""
        if self.cache.hicache_size_gb > 0:
            slots = int(self.cache.hicache_size_gb * GB) // slot_bytes
            if slots < 1:
                raise ConfigError(f"{CONNECTOR}: hicache_size {self.cache.hicache_size_gb} GB "
                                  f"holds no page of {slot_bytes} bytes; raise it")
            return slots
        return max(1, math.ceil(self.cache.hicache_ratio * device_blocks))


def _json_object(text: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{CONNECTOR}: hicache_storage_backend_extra_config is not valid "
                          f"JSON ({exc}); give an object") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{CONNECTOR}: hicache_storage_backend_extra_config must be an "
                          f"object, got {type(data).__name__}")
    return data
