"""`kvtier bench vllm`: SmolLM2 through vLLM's CPU build, with and without KvtierConnector.

One run, one process, three vLLM engines of the same model, block size, KV cache bytes and
thread binding: A and C with the connector (L2, and a file L3 in a temporary directory shared
through a local Ray cluster and kvtier's namespace actor), B without (vLLM alone); all keep
vLLM's own prefix cache on, as deployed. Each first serves warm-up prompts. Each of `--documents` synthetic
documents of `--tokens` tokens (bench prefix's sensor log, a different log per document) is
asked `--questions` questions:
- B answers every question: the reference tokens (greedy, `--new-tokens`);
- A answers the first question cold (`ttft_cold_s`), then, after vLLM's own prefix cache was
  reset each time (`LLM.reset_prefix_cache`: the document is gone from vLLM's device memory),
  the same question again and every other question: the document's blocks come from L2
  (`ttft_l2_s`, `ttft_l2_ratio` = the same question's L2 TTFT / its cold TTFT);
- `identical`: A's greedy tokens equal B's on every question;
- `no_reuse_overhead`: `--pairs` distinct prompts of the document's length that nothing can
  reuse, A and B interleaved, the median of A's TTFT / B's (the cost of saving every block);
- `ttft_l3_ratio`: C, an engine with processes of its own and nothing in its L2, asks each
  document's first question once A's pages are published: its blocks come from L3
  (`ttft_l3_s` / the same question's cold TTFT);
- `save_gbps`, `load_gbps`: A's copies between vLLM's blocks and its host pool (its
  `vllm:kvtier_*` counters).
With `--peer nixl` (or `mooncake`) L3 is off and A and C read each other's host pools
(peer-to-peer L2): C's blocks come from A's L2 instead (`ttft_peer_s`, `ttft_peer_ratio`, in
place of the L3 fields), once the directory lists them in A's L2.
- `ttft_l2_beside_reader_s`: A's L2 TTFT on the same questions again, while C is up: C's
  hits run with three engines up and `ttft_l2_s` with two, and a third engine's processes
  slow every hit on a small host; `ttft_l3_over_l2` (or `ttft_peer_over_l2`) compares C's
  hits with A's own under the same load.
TTFT is a one-token generate's wall time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any, NamedTuple

from kvtier.bench import emit, stdout_to_stderr
from kvtier.bench.prefix import document_tokens
from kvtier.errors import ConfigError

TARGETS = {"ttft_l2_ratio": 0.15, "ttft_l3_ratio": 0.2, "no_reuse_overhead": 1.05}  # at most
PEER_TARGETS = {"ttft_l2_ratio": 0.15, "ttft_peer_ratio": 0.2, "no_reuse_overhead": 1.05}
QUESTION = "\n\nQuestion: what did the sensor in room {room} read in record {record}? Answer:"
KV_CACHE_BYTES = 256 << 20


class VllmBenchParams(NamedTuple):
    tokens: int = 2048
    documents: int = 2
    questions: int = 4
    new_tokens: int = 8
    pairs: int = 5
    block_size: int = 128
    hicache_ratio: float = 2.0
    peer: str | None = None  # peer-to-peer L2 over this transport, L3 off


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = VllmBenchParams()
    p.add_argument("--tokens", type=int, default=d.tokens, help="document length in tokens")
    p.add_argument("--documents", type=int, default=d.documents)
    p.add_argument("--questions", type=int, default=d.questions, help="questions per document")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens)
    p.add_argument("--pairs", type=int, default=d.pairs,
                   help="no-reuse prompt pairs (with and without the connector)")
    p.add_argument("--block-size", type=int, default=d.block_size,
                   help="vLLM's block size, a multiple of 32 (a kvtier page)")
    p.add_argument("--hicache-ratio", type=float, default=d.hicache_ratio)
    p.add_argument("--peer", choices=("nixl", "mooncake"), default=None,
                   help="L3 off; the second engine reads the first's host pool over it")
    p.add_argument("--json", action="store_true")


class L3Setup(NamedTuple):
    address: str  # the local Ray cluster's
    root: str  # the file L3's directory (with peers: where their namespace is registered)
    peer: str | None = None  # peers over this transport, L3 off


def engine(model: str, params: VllmBenchParams, l3: L3Setup | None,
           metrics: bool = False) -> Any:
    """One engine; with `l3`, with the connector on that L3, or with peers and L3 off
    (`metrics`: vLLM's registry)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    transfer = None
    if l3 is not None:
        tiers: dict[str, Any] = (
            {"peer_transport": l3.peer, "l3_state_dir": l3.root} if l3.peer else
            {"hicache_storage_backend": "file",
             "hicache_storage_backend_extra_config": {"root_dir": l3.root}})
        transfer = KVTransferConfig(
            kv_connector="KvtierConnector", kv_role="kv_both",
            kv_connector_extra_config={
                "hicache_ratio": params.hicache_ratio, **tiers,
                "hicache_storage_prefetch_policy": "wait_complete", "ray_address": l3.address})
    return LLM(model=model, enforce_eager=True, enable_prefix_caching=True,
               max_model_len=params.tokens + 256, max_num_seqs=4,
               block_size=params.block_size, kv_cache_memory_bytes=KV_CACHE_BYTES,
               disable_log_stats=not metrics, kv_transfer_config=transfer)


def wait_published(actor: Any, prompt: list[int], block_size: int,
                   timeout_s: float = 120.0) -> None:
    """Until the L3 directory publishes every page `prompt` can reuse (A's ranks write and
    report them in the background)."""
    (ns,) = actor.namespaces()
    keys = actor.info(ns).spec.key_namespace.page_hashes(prompt, block_size)
    keys = keys[:(len(prompt) - 1) // block_size]
    deadline = time.monotonic() + timeout_s
    while actor.lookup(ns, keys).hit_pages < len(keys):
        if time.monotonic() > deadline:
            raise TimeoutError("A's pages were not published in L3 within "
                               f"{timeout_s:.0f} s")
        time.sleep(0.05)


def wait_listed(actor: Any, prompt: list[int], block_size: int, holder: str,
                timeout_s: float = 120.0) -> None:
    """Until the directory lists every page `prompt` can reuse in `holder`'s L2 (its
    scheduler side reports them in the background)."""
    (ns,) = actor.namespaces()
    keys = actor.info(ns).spec.key_namespace.page_hashes(prompt, block_size)
    keys = keys[:(len(prompt) - 1) // block_size]
    deadline = time.monotonic() + timeout_s
    while {h.holder: h.pages for h in actor.l2_holders(ns, keys)}.get(holder) != len(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"A's pages were not listed in its L2 within {timeout_s:.0f} s")
        time.sleep(0.05)


def answer(llm: Any, prompt: list[int], new_tokens: int) -> list[int]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return list(out.outputs[0].token_ids)


def ttft(llm: Any, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first token, tokens the request found cached)."""
    from vllm import SamplingParams

    start = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1,
                                                                      temperature=0),
                       use_tqdm=False)[0]
    return time.perf_counter() - start, out.num_cached_tokens or 0


def copy_counters() -> dict[str, float]:
    """The connector's byte and second counters in this process's registry (vLLM records
    them in its front end; LLM.get_metrics would read the seconds as ints)."""
    from prometheus_client import REGISTRY

    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name.startswith("vllm:kvtier_") and sample.name.endswith("_total"):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def gbps(counters: dict[str, float], kind: str) -> float | None:
    size = counters.get(f"vllm:kvtier_{kind}_bytes_total", 0.0)
    seconds = counters.get(f"vllm:kvtier_{kind}_seconds_total", 0.0)
    return round(size / seconds / 1e9, 3) if seconds > 0 else None


def prompts(tokenizer, params: VllmBenchParams, doc: int) -> list[list[int]]:
    """Document `doc` (the sensor log under a header of its own, so no two documents share
    a block) and its questions."""
    header = tokenizer.encode(f"Log {doc}.\n")
    body = header + document_tokens(tokenizer, params.tokens - len(header))
    return [body + tokenizer.encode(QUESTION.format(room=(doc + q) % 17, record=12 + 7 * q))
            for q in range(params.questions)]


def run(params: VllmBenchParams = VllmBenchParams()) -> dict:
    from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
    from kvtier.actors.ray_env import cluster_address, local_ray

    if params.block_size % 32 or params.tokens < 2 * params.block_size:
        raise ConfigError("--block-size must be a multiple of 32 and --tokens at least two "
                          "blocks")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")  # every engine: the same core
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-vllm-") as tmp, local_ray(1):
        actor = get_or_create_namespace_actor(state_dir=os.path.join(tmp, "state"))
        l3 = L3Setup(cluster_address(), os.path.join(tmp, "l3"), params.peer)
        os.makedirs(l3.root)
        try:
            return _measure(params, l3, actor)
        finally:
            actor.shutdown()


def _measure(params: VllmBenchParams, l3: L3Setup, actor: Any) -> dict:
    from kvtier.engine.hf_export import smollm2_hf_dir
    from kvtier.engine.tokenizer import Tokenizer
    from kvtier.engine.weights import ensure_converted

    tokenizer = Tokenizer.from_files(ensure_converted())
    model = str(smollm2_hf_dir())
    with_kv, alone = engine(model, params, l3, metrics=True), engine(model, params, None)
    docs = [prompts(tokenizer, params, d) for d in range(params.documents + 1)]
    for llm in (with_kv, alone):  # warm-up: first-call setup, a long prompt, a hit
        ttft(llm, docs[-1][0])
        ttft(llm, docs[-1][0])
    with_kv.reset_prefix_cache()
    ttft(with_kv, docs[-1][0])  # and a load from L2
    identical, cold, l2, l2_other = True, [], [], []
    for questions in docs[:-1]:
        reference = [answer(alone, q, params.new_tokens) for q in questions]
        cold.append(ttft(with_kv, questions[0])[0])
        for i, question in enumerate([questions[0], *questions[1:]]):
            with_kv.reset_prefix_cache()
            (l2 if i == 0 else l2_other).append(ttft(with_kv, question)[0])
        for question, expected in zip(questions, reference):
            with_kv.reset_prefix_cache()
            identical &= answer(with_kv, question, params.new_tokens) == expected
    ratios = []
    for pair in range(params.pairs):
        fresh = tokenizer.encode(f"Unrelated text {pair}: ") + docs[0][0][:params.tokens]
        ratios.append(ttft(with_kv, fresh)[0] / ttft(alone, fresh)[0])  # new to both
    counters = copy_counters()
    holder = str(with_kv.llm_engine.vllm_config.kv_transfer_config.engine_id)
    l3_reads, l2_beside = _from_other(params, l3, actor, model, docs, holder, with_kv)
    return report(params, identical, Timings(cold, l2, l2_other, l3_reads, l2_beside), ratios,
                  counters)


def _from_other(params: VllmBenchParams, l3: L3Setup, actor: Any, model: str,
                docs: list[list[list[int]]], holder: str, writer: Any
                ) -> tuple[list[float], list[float]]:
    """C's TTFT on each document's first question, its blocks read from L3 (with peers:
    from A's host pool); then A's on the same questions from its own L2 while C is up (the
    same engines running as for C's)."""
    reader = engine(model, params, l3)
    ttft(reader, docs[-1][0])  # warm-up: first-call setup (the warm-up document is A's)
    seconds = []
    for questions in docs[:-1]:
        if l3.peer:
            wait_listed(actor, questions[0], params.block_size, holder)
        else:
            wait_published(actor, questions[0], params.block_size)
        seconds.append(ttft(reader, questions[0])[0])
    l2_beside = []
    for questions in docs[:-1]:
        writer.reset_prefix_cache()
        l2_beside.append(ttft(writer, questions[0])[0])
    return seconds, l2_beside


class Timings(NamedTuple):
    cold: list[float]  # each document's first question, cold on A
    l2: list[float]  # the same question on A from L2
    l2_other: list[float]  # its other questions on A, the document from L2
    l3: list[float]  # the first question on C, from L3 (with peers: from A's L2)
    l2_beside: list[float]  # the same question on A from its L2 again, C up


def report(params: VllmBenchParams, identical: bool, t: Timings, ratios: list[float],
           counters: dict[str, float]) -> dict:
    import vllm

    ttft_cold = statistics.median(t.cold)
    tier = "peer" if params.peer else "l3"
    result: dict[str, Any] = {
        "identical": identical, "ttft_cold_s": round(ttft_cold, 4),
        "ttft_l2_s": round(statistics.median(t.l2), 4),
        "ttft_l2_ratio": round(statistics.median(t.l2) / ttft_cold, 4),
        "ttft_l2_other_question_s": (round(statistics.median(t.l2_other), 4)
                                     if t.l2_other else None),
        f"ttft_{tier}_s": round(statistics.median(t.l3), 4),
        f"ttft_{tier}_ratio": round(statistics.median(t.l3) / ttft_cold, 4),
        "ttft_l2_beside_reader_s": round(statistics.median(t.l2_beside), 4),
        f"ttft_{tier}_over_l2": round(statistics.median(t.l3) / statistics.median(t.l2_beside),
                                      4),
        "no_reuse_overhead": round(statistics.median(ratios), 4),
        "save_gbps": gbps(counters, "backup"), "load_gbps": gbps(counters, "load_back"),
        "tokens": params.tokens, "documents": params.documents,
        "questions": params.questions * params.documents, "pairs": params.pairs,
        "block_size": params.block_size, "kv_cache_bytes": KV_CACHE_BYTES,
        "hicache_ratio": params.hicache_ratio, "peer": params.peer, "vllm": vllm.__version__,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
        "load_avg_1m": round(os.getloadavg()[0], 2)}
    targets = PEER_TARGETS if params.peer else TARGETS
    result["targets_met"] = identical and all(result[k] <= v for k, v in targets.items())
    return result


def main(ns: argparse.Namespace) -> int:
    params = VllmBenchParams(ns.tokens, ns.documents, ns.questions, ns.new_tokens, ns.pairs,
                             ns.block_size, ns.hicache_ratio, ns.peer)
    with stdout_to_stderr(ns.json):  # vLLM's processes log on stdout
        result = run(params)
    emit(result, ns.json)
    return 0
