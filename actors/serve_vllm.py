"""The instance deployment of an `engine: vllm` graph: one vLLM engine with KvtierConnector
(kvtier.vllm_engine.instance) behind an `InstanceServer`, where an `engine: kvtier` graph has
kvtier's rank actors (actors/serve_instance). See docs/vllm.md.

The ingress and the router treat it as any instance: it streams `AnswerItem`s, answers the
router's poll with its load and cache events, and describes the key space of those events.
vLLM's prefix cache is its L1 (vLLM's KV events), the connector's host pool its L2 and the
shared L3 namespace its L3 (the connector's events, `take_events`); both reach the router
keyed by tokens in the graph's key space (`event_namespace`), whatever vLLM hashes them with.

The replica holds the instance's CPUs (`num_cpus_per_rank` x `tp_size`): vLLM's engine and
workers are its child processes, which Ray does not schedule. What kvtier's instance offers
and a vLLM engine does not (pins, rank faults and audits, L3 attached at run time) is refused
with an error that says so (pins by the ingress); fault drills get the engine's processes
and its own audit instead (`engine_processes`, `engine_audit`).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import ray
import torch
from ray import serve

from kvtier.actors.instance_server import InstanceServer
from kvtier.actors.serve_replica import ServedReplica, final_fields, l3_options
from kvtier.config import (CONNECTOR_FIELDS, CONNECTOR_PEER_KEY, HiCacheConfig,
                           HiCacheConfigRecord, connector_key)
from kvtier.dtypes import DType
from kvtier.errors import ConfigError
from kvtier.frontend.records import (AnswerFinal, InstanceSnapshot, L3Attachment, ReplicaConfig,
                                     ReplicaDescription, ReplicaFlush, ReplicaSnapshot,
                                     ReplicaStorage, RunningConfig)
from kvtier.frontend.settings import HICACHE_OWNED, ModelChoice, ServeSettings
from kvtier.keys import KeyNamespace
from kvtier.messages import pack_record

# the cache knobs a deployment's `hicache` hands the connector: those it takes, less the ones
# the deployment sets itself (its ratio, its L3); the others are kvtier's engine's
CONNECTOR_KNOBS = tuple(f for f in CONNECTOR_FIELDS if f not in HICACHE_OWNED)
MAX_NUM_SEQS = 16
KV_SLACK = 1.05
# the deployment's dtype as vLLM names it (auto: the checkpoint's, vLLM's own default)
VLLM_DTYPES = {DType.AUTO: "auto", DType.BF16: "bfloat16", DType.FP32: "float32"}


def event_namespace(s: ServeSettings) -> KeyNamespace:
    """The key space the router hashes prompts in and the instances key their events in."""
    return KeyNamespace(f"vllm/{s.served_model_name}", "", f"vllm-block{s.page_size}")


def model_dir(s: ServeSettings) -> str:
    """The Hugging Face directory vLLM loads: SmolLM2's made from the GGUF kvtier ships."""
    if s.model is ModelChoice.SMOLLM2:
        from kvtier.engine.hf_export import smollm2_hf_dir

        return str(smollm2_hf_dir())
    return s.model_path


def hf_config(directory: str) -> dict:
    """The config.json of the model directory vLLM loads (`model_dir`)."""
    return json.loads((Path(directory) / "config.json").read_text())


def kv_heads(config: dict) -> int:
    """The model's KV heads, from its config.json (`hf_config`)."""
    return int(config.get("num_key_value_heads", config["num_attention_heads"]))


def block_bytes(directory: str, block_size: int, dtype_bytes: int = 2) -> tuple[int, int]:
    """(bytes of one KV block over every layer, the model's context length), from its
    config.json (16-bit KV: what vLLM keeps on this machine's CPUs and on GPUs)."""
    config = hf_config(directory)
    heads = kv_heads(config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_block = config["num_hidden_layers"] * heads * head_dim * 2 * block_size * dtype_bytes
    return per_block, int(config.get("max_position_embeddings", 4096))


def connector_config(s: ServeSettings, ray_address: str | None) -> dict[str, Any]:
    """KvtierConnector's `kv_connector_extra_config` for this deployment (SGLang's names)."""
    other = sorted(set(s.hicache) - set(CONNECTOR_KNOBS))
    if other:
        raise ConfigError(f"engine vllm: hicache knob(s) {', '.join(other)} are kvtier "
                          f"engine's; under vLLM the connector takes "
                          f"{', '.join(CONNECTOR_KNOBS)} (docs/vllm.md)")
    extra: dict[str, Any] = {connector_key("hicache_ratio"): s.hicache_ratio,
                             "l3_actor": s.l3_actor,
                             **{connector_key(k): v for k, v in s.hicache.items()}}
    if s.l3_state_dir:
        extra["l3_state_dir"] = s.l3_state_dir
    if ray_address:
        extra["ray_address"] = ray_address
    if s.storage_backend is not None:
        extra[connector_key("storage_backend")] = s.storage_backend.value
        extra[connector_key("storage_options")] = json.dumps(
            l3_options(s.storage_backend, s, None))
    if s.peer_transport is not None:  # the engines read each other's host pools
        extra[CONNECTOR_PEER_KEY] = s.peer_transport.value
    return extra


def vllm_settings(s: ServeSettings, ray_address: str | None) -> Any:
    """One engine's settings: L1 of `device_pages` blocks of `page_size` tokens, the
    connector's L2 `hicache_ratio` times that (and L3 as the deployment says), at most
    `chunk_tokens` computed per step, admitted hit-first (kvtier.connector.vllm_scheduler)."""
    from kvtier.vllm_engine.instance import VllmSettings

    directory = model_dir(s)
    per_block, context = block_bytes(directory, s.page_size,
                                     4 if s.dtype is DType.FP32 else 2)
    connector = connector_config(s, ray_address) if s.enable_hierarchical_cache else None
    # vLLM makes a few percent fewer blocks than these bytes hold of KV: ask for more
    return VllmSettings(directory, block_size=s.page_size,
                        kv_cache_bytes=math.ceil(s.device_pages * per_block * KV_SLACK),
                        max_model_len=min(context, s.device_pages * s.page_size),
                        max_num_seqs=MAX_NUM_SEQS, tp_size=s.tp_size, connector=connector,
                        batched_tokens=s.chunk_tokens, hit_first=True,
                        dtype=VLLM_DTYPES[s.dtype])


def _not_here(what: str) -> ConfigError:
    return ConfigError(f"{what} is not supported with engine vllm (a vLLM engine has no "
                       f"kvtier ranks); serve with engine kvtier for it")


@serve.deployment(max_ongoing_requests=1024, health_check_period_s=5,
                  graceful_shutdown_timeout_s=30, graceful_shutdown_wait_loop_s=0.2)
class VllmDeployment(ServedReplica):
    """One `engine: vllm` instance (`serve_graph.build_app` gives it its CPUs)."""

    def __init__(self, name: str, settings: dict, index: int = 0) -> None:
        """`index`: the instance's place in the graph; on CPUs its engine computes on core
        `index` modulo this node's."""
        s = self._open(name, settings)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub at run time
        if not torch.cuda.is_available():  # instances side by side: a core each, in turn
            cores = sorted(os.sched_getaffinity(0))
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cores[index % len(cores)])
        from kvtier.vllm_engine.instance import VllmInstance

        self.keys = event_namespace(s)
        self.vllm = vllm_settings(s, ray.get_runtime_context().gcs_address
                                  )._replace(engine_id=name)
        self.server = InstanceServer(VllmInstance(self.vllm, event_keys=self.keys), name)
        if s.storage_backend is not None:  # the connector attached it (its own namespace id)
            self.l3 = L3Attachment(s.storage_backend, "",
                                   l3_options(s.storage_backend, s, None))

    def _final(self, out: Any) -> AnswerFinal:
        return final_fields(out, self.name)

    def _members(self, target: Any) -> list:
        raise _not_here("this call")

    # ---- router and operator calls ------------------------------------------------------------
    async def describe(self) -> bytes:
        k = self.keys
        return ReplicaDescription(k.model, k.tenant_salt, k.layout_fingerprint,
                                  self.settings.page_size, self.name,
                                  self.settings.tp_size).to_msgpack()

    async def snapshot(self) -> bytes:
        """kvtier's counters of the engine: its requests' hits by tier and the connector's
        copies (vLLM's stats carry them; vLLM's own metrics have the connector's families
        too). L2 use is not known outside vLLM's EngineCore: 0."""
        counters = await self._call(lambda inst: inst.counters())
        return ReplicaSnapshot((InstanceSnapshot(self.name, counters.cache, counters.storage,
                                                 0, 0, {}, (), {}, 0),)).to_msgpack()

    async def flush(self) -> bytes:
        """Drop vLLM's prefix cache (L1); the connector's L2 and L3 keep their pages. vLLM
        refuses while requests run: a ConfigError then (the admin API's 400)."""
        free = await self._call(lambda inst: inst.drop_cache())
        if free is None:
            raise ConfigError(f"instance {self.name}: vLLM does not reset its prefix cache "
                              f"while requests run; retry when it is idle")
        return ReplicaFlush(self.name, free).to_msgpack()

    async def config(self) -> bytes:
        s, v = self.settings, self.vllm
        config = HiCacheConfig(page_size=s.page_size, hicache_ratio=s.hicache_ratio,
                               enable_hierarchical_cache=s.enable_hierarchical_cache)
        facts = await self._call(lambda inst: inst.facts())
        running = RunningConfig(HiCacheConfigRecord.of(config), s.l3_name, v.model_dir,
                                facts.dtype, facts.batched_tokens, False,
                                "hit_first" if v.hit_first else "fcfs", facts.blocks,
                                int(facts.blocks * s.hicache_ratio) if v.connector else 0,
                                engine=s.engine.value)
        return ReplicaConfig(self.name, running).to_msgpack()

    async def attach_l3(self, backend: str, options: dict | None) -> bytes:
        raise _not_here("attaching L3 at run time (give storage_backend when serving)")

    async def detach_l3(self) -> bytes:
        raise _not_here("detaching L3 at run time")

    async def storage(self) -> bytes:
        return ReplicaStorage(self.name, self.l3).to_msgpack()

    async def kill_rank(self, member: int, rank: int) -> bool:
        raise _not_here("kill_rank")

    async def audit(self) -> list[list[bytes]]:
        raise _not_here("the ranks' leak audit (engine_audit is the engine's)")

    # ---- fault drills (kvtier bench chaos --engine vllm: actors/chaos_engines.py) ---------------
    async def engine_processes(self) -> bytes:
        """The pids of this replica's vLLM EngineCore and workers: an `EngineProcesses`
        record (msgpack), for a drill that signals them."""
        from kvtier.vllm_engine.processes import engine_processes

        return pack_record(engine_processes())

    async def engine_audit(self) -> bytes:
        """What the engine holds with no request running, between two steps: an
        `EngineAudit` record (msgpack; `idle` False while requests run)."""
        return pack_record(await self._call(lambda inst: inst.audit()))
