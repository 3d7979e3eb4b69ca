"""An L3 page written by a TP 1 vLLM engine is read by a TP 2 one: each TP 2 worker reads its
own KV head's objects of the page, and a page one rank cannot read (its head's objects
corrupt) is a miss for both, while the other rank reads it. A tiny random Llama (2 KV heads of 32 dims, SmolLM2's
tokenizer): SmolLM2's 3 KV heads do not split over 2 ranks."""
from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from vllm_required import require_vllm

require_vllm()

BLOCK = 32


def tiny_llama(path: Path) -> Path:
    import torch
    import transformers

    from kvtier.engine.weights import ensure_converted

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, vocab_size=49152, max_position_embeddings=1024,
        rms_norm_eps=1e-5, tie_word_embeddings=True, torch_dtype="bfloat16")
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    shutil.copy(ensure_converted() / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    return path


def engine(model: Path, tp: int, address: str, root: Path, peers: bool = False):
    """An engine with a file L3 under `root`, or with `peers` L3 off and peer-to-peer L2 on
    (its namespace registered under `root`)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0|1" if tp == 2 else "1"  # a core per rank
    extra = ({"peer_transport": "nixl", "l3_state_dir": str(root)} if peers else
             {"hicache_storage_backend": "file",
              "hicache_storage_backend_extra_config": {"root_dir": str(root)}})
    extra.update({"hicache_storage_prefetch_policy": "wait_complete", "ray_address": address})
    return LLM(model=str(model), enforce_eager=True, enable_prefix_caching=False,
               max_model_len=1024, max_num_seqs=2, kv_cache_memory_bytes=32 << 20,
               tensor_parallel_size=tp, block_size=BLOCK, disable_log_stats=not peers,
               kv_transfer_config=KVTransferConfig(kv_connector="KvtierConnector",
                                                   kv_role="kv_both",
                                                   kv_connector_extra_config=extra))


def answer(llm, prompt: list[int], salt: str | None = None) -> tuple[int, list[int]]:
    from vllm import SamplingParams

    request = {"prompt_token_ids": prompt, **({"cache_salt": salt} if salt else {})}
    out = llm.generate([request], SamplingParams(max_tokens=8, temperature=0,
                                                 ignore_eos=True), use_tqdm=False)[0]
    return out.num_cached_tokens or 0, list(out.outputs[0].token_ids)


def test_a_page_written_at_tp1_is_read_at_tp2(tmp_path):
    from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
    from kvtier.actors.ray_env import cluster_address, local_ray

    model = tiny_llama(tmp_path / "tiny")
    prompt = list(range(1000, 1300))  # 9 full blocks, the 10th computed
    torn = list(range(3000, 3300))  # the same length, one head of its 4th page corrupt
    with local_ray(2):
        actor = get_or_create_namespace_actor(state_dir=str(tmp_path / "state"))
        address = cluster_address()
        writer = engine(model, 1, address, tmp_path / "l3")
        assert answer(writer, prompt)[0] == 0 and answer(writer, torn)[0] == 0
        writer.llm_engine.engine_core.shutdown()  # its L3 writes end with it
        (ns,) = actor.namespaces()
        spec = actor.info(ns).spec.key_namespace
        keys, torn_keys = (spec.page_hashes(p, BLOCK)[:9] for p in (prompt, torn))
        deadline = time.monotonic() + 60
        while actor.lookup(ns, keys + torn_keys).hit_pages < 2 * len(keys):
            assert time.monotonic() < deadline, "the TP 1 writer's pages were not published"
            time.sleep(0.05)
        # rank 1 of the reader reads KV head 1: its objects of the 4th page are garbage, so
        # rank 1 fails that page while rank 0 reads it (and the pages after it) whole
        victims = list((tmp_path / "l3").rglob(f"*{torn_keys[3]}_h1_*"))
        assert len(victims) == 2  # K and V
        for path in victims:
            path.write_bytes(b"\0" * path.stat().st_size)
        reader = engine(model, 2, address, tmp_path / "l3")
        cold = answer(reader, prompt, salt="cold")  # its own keys: computed at TP 2
        hit = answer(reader, prompt)
        torn_cold = answer(reader, torn, salt="cold")
        torn_hit = answer(reader, torn)
        reader.llm_engine.engine_core.shutdown()
        actor.shutdown()
    assert cold[0] == 0 and hit == (9 * BLOCK, cold[1])
    # the three pages both ranks read, then computed from the page rank 1 could not read
    assert torn_cold[0] == 0 and torn_hit == (3 * BLOCK, torn_cold[1])


def test_a_tp2_engine_reads_the_pages_a_tp1_engine_holds_in_its_host_pool(tmp_path):
    """Peer-to-peer L2 across TP sizes, L3 off: each TP 2 worker reads its own KV head of
    every page from the TP 1 engine's one host pool."""
    from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
    from kvtier.actors.ray_env import cluster_address, local_ray

    model = tiny_llama(tmp_path / "tiny")
    prompt = list(range(2000, 2300))  # 9 full blocks, the 10th computed
    with local_ray(2):
        actor = get_or_create_namespace_actor(state_dir=str(tmp_path / "state"))
        address = cluster_address()
        holder = engine(model, 1, address, tmp_path / "peers", peers=True)
        try:
            assert answer(holder, prompt)[0] == 0
            (ns,) = actor.namespaces()
            keys = actor.info(ns).spec.key_namespace.page_hashes(prompt, BLOCK)[:9]
            name = str(holder.llm_engine.vllm_config.kv_transfer_config.engine_id)
            deadline = time.monotonic() + 60
            while {h.holder: h.pages for h in actor.l2_holders(ns, keys)}.get(name) != 9:
                assert time.monotonic() < deadline, "the TP 1 engine's L2 pages not listed"
                time.sleep(0.05)
            reader = engine(model, 2, address, tmp_path / "peers", peers=True)
            cold = answer(reader, prompt, salt="cold")  # its own keys: computed at TP 2
            before = by_tier(reader)
            hit = answer(reader, prompt)
            after = by_tier(reader)
            again = answer(reader, prompt)  # what it read is in its own L2 now
            reader.llm_engine.engine_core.shutdown()
        finally:
            holder.llm_engine.engine_core.shutdown()
        actor.shutdown()
    assert cold[0] == 0 and hit == (9 * BLOCK, cold[1]) and again == hit
    # counted as vLLM's P2P source and kvtier's peer tier
    assert {k: after.get(k, 0) - before.get(k, 0) for k in after} == {
        "vllm:kvtier_hit_tokens{tier=host}": 0, "vllm:kvtier_hit_tokens{tier=storage}": 0,
        "vllm:kvtier_hit_tokens{tier=peer}": 9 * BLOCK,
        "vllm:prompt_tokens_cached_by_source{source=p2p}": 9 * BLOCK}


def by_tier(llm) -> dict[str, float]:
    """The connector's hit tokens by tier, and vLLM's cached tokens from P2P."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        for label, wanted in (("tier", "vllm:kvtier_hit_tokens"),
                              ("source", "vllm:prompt_tokens_cached_by_source")):
            if metric.name == wanted and label in metric.labels and (
                    label == "tier" or metric.labels[label] == "p2p"):
                name = f"{metric.name}{{{label}={metric.labels[label]}}}"
                out[name] = out.get(name, 0) + metric.value
    return out
