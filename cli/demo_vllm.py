"""`kvtier demo --engine vllm`: the demo's story with two vLLM engines (SmolLM2, vLLM's CPU
build here) whose L2 and L3 are kvtier's (KvtierConnector, docs/vllm.md).

Instance A computes the document with the first question, hits it in vLLM's prefix cache (L1)
with the second, and in the connector's L2 with the third once its prefix cache is flushed;
instance B, another engine, reads it from the shared file L3 for the third question. Each
answer must equal the cold one: the same prompt on A under a cache salt of its own, which
shares no page with anything (vLLM computes all of it). Ray runs only the L3 namespace actor;
the engines run in this process's children, each on a core of its own.
"""
from __future__ import annotations

import json
import math
import os
import queue
import tempfile
import time
from typing import Any

from kvtier.cli.demo import PLAN, QUESTIONS, DemoParams, _workload, demo_model
from kvtier.cli.demo_flags import DEFAULT_MODEL
from kvtier.cli.demo_report import Row, format_table
from kvtier.errors import ConfigError

PREFIX_BLOCKS = 64  # tokens per vLLM block
REQUEST_TIMEOUT_S = 600.0


def check(params: DemoParams, tp_given: bool) -> None:
    """What the vLLM demo runs: SmolLM2 at TP 1 with a file L3 on local Ray."""
    if params.model != DEFAULT_MODEL:
        raise ConfigError("--engine vllm runs SmolLM2 (made a Hugging Face directory from the "
                          "GGUF kvtier ships); drop --model")
    if tp_given and params.tp_size != 1:
        raise ConfigError("--engine vllm runs each engine at TP 1 here; drop --tp")
    if params.l3 != "file" or params.hosts or params.address or params.nodes:
        raise ConfigError("--engine vllm runs on local Ray with a file L3; drop --l3, "
                          "--hosts, --address and --place")
    if params.hicache:
        raise ConfigError("--engine vllm takes no --hicache-* flags; docs/vllm.md says what "
                          "the connector takes")


def main(params: DemoParams, json_only: bool) -> int:
    from kvtier.actors.ray_env import cluster_address, shutdown_local_ray, start_local_ray

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # the demo prints its story; vLLM's start-up log in every engine process (hundreds of
    # lines, warnings about CPU libraries and weight dtypes included) would bury it
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    work = _workload(params, demo_model(params.model))
    started = time.perf_counter()
    servers: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-vllm-") as root:
        start_local_ray(num_cpus=2)
        address = cluster_address()
        try:
            for core, name in enumerate(("A", "B")):
                servers[name] = _engine(name, core, root, address, work)
            rows = _story(servers, work)
        finally:
            for server in servers.values():
                server.close()
            shutdown_local_ray()
    tok = work.model.tokenizer
    rows = [r._replace(text=tok.decode(list(r.out.tokens))) for r in rows]
    result = {"identical": all(r.identical for r in rows),
              "tiers_as_expected": all(r.tier == r.expected for r in rows),
              "engine": "vllm", "document_tokens": work.doc_len,
              "ttft_cold_s": round(sum(r.cold.ttft_s for r in rows) / len(rows), 4),
              **{f"ttft_{r.tier.lower()}_ratio": round(r.ratio, 4) for r in rows
                 if r.tier != "compute"},
              "requests": [r.to_json() for r in rows],
              "runtime_s": round(time.perf_counter() - started, 1)}
    if not json_only:
        print(format_table(rows))
        print("questions: " + " | ".join(f"q{i + 1}: {q}" for i, q in enumerate(QUESTIONS)))
        for r in rows:
            print(f"{r.instance} q{r.question} answer: {r.text!r}")
    print(json.dumps(result))
    return 0 if result["identical"] and result["tiers_as_expected"] else 1


def _engine(name: str, core: int, root: str, address: str, work: Any) -> Any:
    """One vLLM engine with the connector (L2 twice its KV, the file L3 under `root`) behind
    an InstanceServer, computing on `core`."""
    from kvtier.actors.instance_server import InstanceServer
    from kvtier.actors.serve_vllm import KV_SLACK, block_bytes
    from kvtier.engine.hf_export import smollm2_hf_dir
    from kvtier.vllm_engine.instance import VllmInstance, VllmSettings

    directory = str(smollm2_hf_dir())
    per_block, _ = block_bytes(directory, PREFIX_BLOCKS)
    longest = max(len(p) for p in work.prompts) + work.greedy.max_new_tokens
    blocks = 2 * -(-longest // PREFIX_BLOCKS) + 4  # two of the longest requests
    extra = {"hicache_ratio": 2.0, "hicache_storage_backend": "file",
             "hicache_storage_backend_extra_config": json.dumps({"root_dir": root}),
             "hicache_storage_prefetch_policy": "wait_complete", "ray_address": address}
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(core % len(os.sched_getaffinity(0)))
    settings = VllmSettings(directory, block_size=PREFIX_BLOCKS,
                            kv_cache_bytes=math.ceil(blocks * per_block * KV_SLACK),
                            max_model_len=blocks * PREFIX_BLOCKS, max_num_seqs=2,
                            connector=extra)
    return InstanceServer(VllmInstance(settings), name)


def _story(servers: dict[str, Any], work: Any) -> list[Row]:
    """The cold answers, then the demo's plan (kvtier.cli.demo.PLAN)."""
    a = servers["A"]
    cold = [_answer(a, prompt, f"cold-{i}-{time.time_ns()}", work)
            for i, prompt in enumerate(work.prompts)]
    rows = []
    for instance, question, expected in PLAN:
        server = servers[instance]
        if (instance, expected) == ("A", "L2"):  # vLLM's prefix cache flushed; L2 kept
            if server.call(lambda inst: inst.drop_cache()).result(REQUEST_TIMEOUT_S) is None:
                raise RuntimeError("vLLM did not reset its prefix cache")
        out = _answer(server, work.prompts[question], "", work)
        rows.append(Row(instance, question + 1, expected, out, cold[question]))
    return rows


def _answer(server: Any, prompt: list[int], salt: str, work: Any) -> Any:
    """One request's Output (greedy), waited for."""
    from kvtier.actors.instance_server import ServerEventKind

    events: queue.Queue = queue.Queue()
    server.submit(prompt, work.greedy, events.put, salt)
    deadline = time.monotonic() + REQUEST_TIMEOUT_S
    while True:
        event = events.get(timeout=max(1.0, deadline - time.monotonic()))
        if event.kind is ServerEventKind.DONE:
            return event.output
        if event.kind is ServerEventKind.ERROR:
            raise RuntimeError(f"instance {server.name} stopped serving: {event.message}")
