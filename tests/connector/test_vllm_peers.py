"""Peer-to-peer L2 between two vLLM engines (KvtierConnector with `peer_transport`, L3 off),
on SmolLM2 in vLLM's CPU build: engine B reads the pages engine A holds in its host pool over
NIXL, verified, and answers as A did; its hit shows as vLLM's P2P source and kvtier's peer
tier. vLLM's own prefix cache is off, so every cached token came from kvtier."""
from __future__ import annotations

import os
from typing import Any, NamedTuple

import pytest
from eventually import eventually

from vllm_required import require_vllm

require_vllm()

BLOCK = 128


class Directory(NamedTuple):
    address: str
    actor: Any  # NamespaceClient


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
    from kvtier.actors.ray_env import cluster_address, shutdown_local_ray, start_local_ray

    start_local_ray(num_cpus=2)
    try:
        state = tmp_path_factory.mktemp("state")
        yield Directory(cluster_address(), get_or_create_namespace_actor(state_dir=str(state)))
    finally:
        shutdown_local_ray()


def engine(directory: Directory, state_dir: str):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.engine.hf_export import smollm2_hf_dir

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    extra = {"hicache_ratio": 2.0, "peer_transport": "nixl",
             "hicache_storage_prefetch_policy": "wait_complete",
             "ray_address": directory.address, "l3_state_dir": state_dir}
    return LLM(model=str(smollm2_hf_dir()), enforce_eager=True, enable_prefix_caching=False,
               max_model_len=2048, max_num_seqs=4, kv_cache_memory_bytes=128 << 20,
               max_num_batched_tokens=512, disable_log_stats=False,
               kv_transfer_config=KVTransferConfig(kv_connector="KvtierConnector",
                                                   kv_role="kv_both",
                                                   kv_connector_extra_config=extra))


@pytest.fixture(scope="module")
def engines(directory, tmp_path_factory):
    state = str(tmp_path_factory.mktemp("peers"))
    a = engine(directory, state)
    try:
        b = engine(directory, state)
        yield a, b
        b.llm_engine.engine_core.shutdown()
    finally:
        a.llm_engine.engine_core.shutdown()


def document(topic: str, items: int = 55) -> str:
    facts = " ".join(f"{topic} {i} is {i * 7 % 13}." for i in range(items))
    return f"Read this list. {facts} Question: what is {topic} 7? Answer:"


def answer(llm, prompt: str):
    from vllm import SamplingParams

    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=1),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    return (out.num_cached_tokens or 0, list(out.prompt_token_ids), list(completion.token_ids),
            [next(iter(lp.values())).logprob for lp in completion.logprobs])


def counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        for label in ("tier", "source"):
            if metric.name.startswith(("vllm:kvtier_hit", "vllm:prompt_tokens_cached_by")) \
                    and label in metric.labels:
                name = f"{metric.name}{{{label}={metric.labels[label]}}}"
                out[name] = out.get(name, 0) + metric.value
    return out


def holder(llm) -> str:
    return str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)


def listed(directory: Directory, llm, prompt_ids: list[int]) -> list[str]:
    """The page keys of `prompt_ids` once the directory lists them all in `llm`'s L2."""
    (ns,) = directory.actor.namespaces()
    keys = directory.actor.info(ns).spec.key_namespace.page_hashes(prompt_ids, BLOCK)
    keys = keys[:(len(prompt_ids) - 1) // BLOCK]
    eventually(lambda: {h.holder: h.pages for h in directory.actor.l2_holders(ns, keys)}
               .get(holder(llm)) == len(keys) or None, 30, "the holder's L2 pages listed",
               interval_s=0.1)
    return keys


def test_an_engine_reads_the_pages_another_holds_in_its_host_pool(engines, directory):
    a, b = engines
    cold_b = answer(b, document("quince"))  # B's own cold answer, for the comparison
    assert cold_b[0] == 0
    cached, prompt_ids, tokens, logprobs = answer(a, document("apricot"))
    assert cached == 0
    listed(directory, a, prompt_ids)
    before = counters(b)
    hit = answer(b, document("apricot"))
    after = counters(b)

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    pages_tokens = (len(prompt_ids) - 1) // BLOCK * BLOCK
    assert hit[0] == pages_tokens > 0
    assert moved("vllm:kvtier_hit_tokens{tier=peer}") == pages_tokens
    assert moved("vllm:prompt_tokens_cached_by_source{source=p2p}") == pages_tokens
    # one forward in each engine computes the prompt's last block over the same bytes: A's
    # answer to the bit
    assert hit[2:] == (tokens, logprobs)
    # what B read is in its L2 now: its own hit next time, and listed under its name
    again = answer(b, document("apricot"))
    assert again[0] == pages_tokens and again[2:] == (tokens, logprobs)
    listed(directory, b, prompt_ids)
