"""What the connector's workers moved, as kvtier's metric families under vLLM.

Each worker counts its copies between vLLM's blocks and its host pool (`CopyStats`,
vllm_engine/copy_stats.py); vLLM sums them over the ranks and steps and records them in its
Prometheus registry under kvtier's family names after vLLM's `vllm:` prefix (`FAMILIES`;
vLLM's `LLM.get_metrics` reads only that prefix).
"""
from __future__ import annotations

import dataclasses

from kvtier.errors import ConfigError
from kvtier.vllm_engine.copy_stats import CopyStats


# Prometheus family (vLLM adds no _total suffix to a counter's name here; the exposition does), labels, CopyStats field, help
FAMILIES = (
    ("vllm:kvtier_hit_tokens", {"tier": "host"}, "hit_tokens",
     "Prompt tokens the connector loaded into vLLM's blocks, by tier"),
    ("vllm:kvtier_hit_tokens", {"tier": "storage"}, "l3_hit_tokens",
     "Prompt tokens the connector loaded into vLLM's blocks, by tier"),
    ("vllm:kvtier_hit_tokens", {"tier": "peer"}, "peer_hit_tokens",
     "Prompt tokens the connector loaded into vLLM's blocks, by tier"),
    ("vllm:kvtier_backup_tokens", {}, "backup_tokens", "Tokens of full blocks saved into L2"),
    ("vllm:kvtier_load_failed_tokens", {}, "failed_load_tokens",
     "Tokens whose load failed; vLLM recomputed them"),
    ("vllm:kvtier_load_back_bytes", {}, "load_back_bytes", "Bytes copied from L2 into vLLM's blocks"),
    ("vllm:kvtier_load_back_seconds", {}, "load_back_seconds", "Seconds spent on those copies"),
    ("vllm:kvtier_backup_bytes", {}, "backup_bytes", "Bytes copied from vLLM's blocks into L2"),
    ("vllm:kvtier_backup_seconds", {}, "backup_seconds", "Seconds spent on those copies"),
    ("vllm:kvtier_unkeyed_requests", {"reason": "adapter"}, "unkeyed_adapter_requests",
     "Requests whose pages the connector could not key: neither loaded nor saved, by reason"),
    ("vllm:kvtier_unkeyed_requests", {"reason": "multimodal"}, "unkeyed_multimodal_requests",
     "Requests whose pages the connector could not key: neither loaded nor saved, by reason"),
)
_FIELDS = {f.name for f in dataclasses.fields(CopyStats)}
_MISSING = [field for _, _, field, _ in FAMILIES if field not in _FIELDS]
if _MISSING:  # a renamed field fails at import, not by a metric that stops moving
    raise ConfigError(f"metric families read CopyStats fields it lacks: {_MISSING}")
