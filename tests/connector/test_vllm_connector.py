"""KvtierConnector inside vLLM's CPU build, on SmolLM2: one engine for most of the module
(starting one takes most of a minute here), a second one in its own processes for L3, both
on a local Ray cluster with the L3 namespace actor and a file L3. vLLM's own prefix cache is
off, so every cached token of a request came from kvtier, and a cold run of the same engine
is vLLM alone. Prompts are prefilled in chunks of 512 tokens (several steps each), as long
prompts are in vLLM."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from eventually import eventually

from vllm_required import require_vllm

require_vllm()

BLOCK = 128


class L3(NamedTuple):
    """The module's Ray cluster, its namespace actor and the file L3's root."""

    address: str
    root: Path
    actor: Any  # NamespaceClient


@pytest.fixture(scope="module")
def l3(tmp_path_factory):
    from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
    from kvtier.actors.ray_env import cluster_address, shutdown_local_ray, start_local_ray

    start_local_ray(num_cpus=2)
    try:  # the actor first, with a state of its own: the connector finds it by name
        actor = get_or_create_namespace_actor(state_dir=str(tmp_path_factory.mktemp("state")))
        yield L3(cluster_address(), tmp_path_factory.mktemp("l3"), actor)
    finally:
        shutdown_local_ray()


def engine(l3: L3):
    """SmolLM2 in vLLM with the connector: L2, and L3 shared through the module's cluster."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.engine.hf_export import smollm2_hf_dir

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    extra = {"hicache_ratio": 2.0, "hicache_storage_backend": "file",
             "hicache_storage_backend_extra_config": {"root_dir": str(l3.root)},
             "hicache_storage_prefetch_policy": "wait_complete", "ray_address": l3.address}
    return LLM(model=str(smollm2_hf_dir()), enforce_eager=True, enable_prefix_caching=False,
               max_model_len=2048, max_num_seqs=4, kv_cache_memory_bytes=128 << 20,
               max_num_batched_tokens=512,
               disable_log_stats=False,  # the connector's metrics reach vLLM's registry
               kv_transfer_config=KVTransferConfig(kv_connector="KvtierConnector",
                                                   kv_role="kv_both",
                                                   kv_connector_extra_config=extra))


@pytest.fixture(scope="module")
def llm(l3):
    engine_a = engine(l3)
    yield engine_a
    engine_a.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def reader(l3, llm):
    """A second engine (its own processes) on the same L3 namespace."""
    engine_b = engine(l3)
    yield engine_b
    engine_b.llm_engine.engine_core.shutdown()


def document(topic: str, items: int = 120) -> str:
    facts = " ".join(f"{topic} {i} is {i * 7 % 13}." for i in range(items))
    return f"Read this list. {facts} Question: what is {topic} 7? Answer:"


def generate(llm, prompt: str, salt: str | None = None):
    from vllm import SamplingParams

    request = {"prompt": prompt} if salt is None else {"prompt": prompt, "cache_salt": salt}
    out = llm.generate([request], SamplingParams(max_tokens=8, temperature=0, logprobs=1),
                       use_tqdm=False)[0]
    completion = out.outputs[0]
    return (out.num_cached_tokens or 0, len(out.prompt_token_ids), list(completion.token_ids),
            [next(iter(lp.values())).logprob for lp in completion.logprobs])


def test_a_repeated_prompt_loads_from_l2_and_answers_as_vllm_alone(llm):
    """One forward computes the cold prompt (under 512 tokens): the hit computes its last
    block over the loaded ones, and its tokens and log-probabilities are the cold run's to
    the bit, so the loaded bytes are exactly the saved ones."""
    cached, length, tokens, logprobs = generate(llm, document("apple", items=55))
    assert cached == 0 and 3 * BLOCK < length < 512
    again = generate(llm, document("apple", items=55))
    assert again[0] == (length - 1) // BLOCK * BLOCK  # all but the last token's block
    assert again[2:] == (tokens, logprobs)


def test_a_prompt_prefilled_in_chunks_saves_every_block(llm):
    """Over 1,000 tokens: two forwards cold, blocks saved after each. The hit's tokens are
    the cold run's; its log-probabilities may differ a little (a few hundredths were seen),
    as with vLLM's own prefix cache: in bf16, vLLM's CPU kernels give results that depend on
    how a prompt was split into forwards."""
    cached, length, tokens, _ = generate(llm, document("grape"))
    assert cached == 0 and length > 1000
    again = generate(llm, document("grape"))
    assert again[0] == (length - 1) // BLOCK * BLOCK and again[2] == tokens


def test_requests_batched_together_share_what_they_save(llm):
    from vllm import SamplingParams

    shared = document("kiwi", items=60)
    prompts = [shared + f" And what is kiwi {n}?" for n in (3, 5, 8)]
    params = SamplingParams(max_tokens=6, temperature=0)
    cold = llm.generate(prompts, params, use_tqdm=False)  # one batch, the same first blocks
    again = llm.generate(prompts[::-1], params, use_tqdm=False)[::-1]
    for first, second in zip(cold, again):
        assert second.num_cached_tokens == (len(second.prompt_token_ids) - 1) // BLOCK * BLOCK
        assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_generated_blocks_are_saved_too(llm):
    from vllm import SamplingParams

    prompt = document("pear", items=40)
    first = llm.generate([prompt], SamplingParams(max_tokens=200, temperature=0,
                                                  ignore_eos=True), use_tqdm=False)[0]
    grown = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    out = llm.generate([{"prompt_token_ids": grown}], SamplingParams(max_tokens=1, temperature=0),
                       use_tqdm=False)[0]
    assert out.num_cached_tokens == (len(grown) - 1) // BLOCK * BLOCK
    assert out.num_cached_tokens > len(first.prompt_token_ids)


def test_cache_salts_never_share_a_block(llm):
    prompt = document("plum")
    assert generate(llm, prompt, salt="tenant-a")[0] == 0
    assert generate(llm, prompt, salt="tenant-b")[0] == 0
    assert generate(llm, prompt)[0] == 0
    assert generate(llm, prompt, salt="tenant-a")[0] > 0


def counters(llm) -> dict[str, float]:
    """kvtier's counter families in vLLM's registry, summed over their labels, and by tier
    (`name{tier=...}`, `name{source=...}`: vLLM's cached tokens by source too)."""
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(("vllm:kvtier_", "vllm:prompt_tokens_cached_by")):
            continue
        out[metric.name] = out.get(metric.name, 0) + metric.value
        for label in ("tier", "source"):
            if label in metric.labels:
                name = f"{metric.name}{{{label}={metric.labels[label]}}}"
                out[name] = out.get(name, 0) + metric.value
    return out


def test_the_copies_show_in_vllms_metrics_under_kvtiers_names(llm):
    before = counters(llm)
    cold = generate(llm, document("fig"))
    hit = generate(llm, document("fig"))
    after = counters(llm)

    def moved(name: str) -> float:
        return after.get(name, 0) - before.get(name, 0)

    assert moved("vllm:kvtier_hit_tokens") == hit[0] > 0
    assert moved("vllm:kvtier_backup_tokens") == (cold[1] - 1) // BLOCK * BLOCK
    assert moved("vllm:kvtier_load_back_bytes") > 0 and moved("vllm:kvtier_backup_bytes") > 0
    assert moved("vllm:kvtier_load_failed_tokens") == 0
    # (the seconds families are there too; LLM.get_metrics reads counters as ints, so a few
    # milliseconds show as 0: tests/connector/test_worker_side.py checks the timing)


def published(l3: L3, prompt_ids: list[int]) -> list[str]:
    """The page keys of `prompt_ids` in the only namespace (vLLM's), once every one is
    published (the writer's ranks write and report them in the background)."""
    (ns,) = l3.actor.namespaces()
    keys = l3.actor.info(ns).spec.key_namespace.page_hashes(prompt_ids, BLOCK)
    keys = keys[:(len(prompt_ids) - 1) // BLOCK]
    deadline = time.monotonic() + 60
    while l3.actor.lookup(ns, keys).hit_pages < len(keys):
        assert time.monotonic() < deadline, "the writer's pages were never published"
        time.sleep(0.05)
    return keys


def test_a_second_engine_reads_from_l3_what_the_first_computed(llm, reader, l3):
    from vllm import SamplingParams

    prompt = document("cherry", items=55)
    first = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, logprobs=1),
                         use_tqdm=False)[0]
    keys = published(l3, list(first.prompt_token_ids))
    # the directory lists the writer's L2 too, under vLLM's engine id
    (ns,) = l3.actor.namespaces()
    writer = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    eventually(lambda: {h.holder: h.pages for h in l3.actor.l2_holders(ns, keys)}.get(writer)
               == len(keys) or None, 30, "the writer's L2 pages listed", interval_s=0.1)
    before = counters(reader)
    cached, length, tokens, logprobs = generate(reader, prompt)
    assert cached == (length - 1) // BLOCK * BLOCK > 0
    after = counters(reader)
    assert after["vllm:kvtier_hit_tokens{tier=storage}"] - before.get(
        "vllm:kvtier_hit_tokens{tier=storage}", 0) == cached
    assert after.get("vllm:prompt_tokens_cached_by_source{source=disk}", 0) - before.get(
        "vllm:prompt_tokens_cached_by_source{source=disk}", 0) == cached
    assert (tokens, logprobs) == (list(first.outputs[0].token_ids),
                                  [next(iter(lp.values())).logprob
                                   for lp in first.outputs[0].logprobs])
    # the reader keeps what it read in its L2: listed under its own id as well
    ours = reader.llm_engine.vllm_config.kv_transfer_config.engine_id
    eventually(lambda: {h.holder for h in l3.actor.l2_holders(ns, keys)} >= {writer, ours}
               or None, 30, "the reader's L2 pages listed", interval_s=0.1)


def test_an_engine_that_goes_idle_still_writes_its_last_pages_to_l3(llm, l3):
    """A one-token answer ends in the step that saved the prompt's last blocks; the step
    vLLM runs to retire the finished request carries their L3 writes, so they are published
    with no other request."""
    from vllm import SamplingParams

    out = llm.generate([document("damson", items=55)],
                       SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)[0]
    published(l3, list(out.prompt_token_ids))  # its deadline: 60 s


def test_a_corrupt_l3_object_is_recomputed_and_the_answer_stays(llm, reader, l3):
    prompt = document("date", items=55)
    cold = generate(llm, prompt)
    first = llm.generate([prompt], use_tqdm=False)[0]
    keys = published(l3, list(first.prompt_token_ids))
    for path in l3.root.rglob(f"*{keys[1]}*"):  # every object of the second page
        path.write_bytes(b"\0" * path.stat().st_size)
    cached, _, tokens, _ = generate(reader, prompt)
    assert cached == BLOCK and tokens == cold[2]  # the first page from L3, the rest computed
