"""`kvtier bench prefix`: TTFT of one long-document question on SmolLM2 (or Gemma-3 270M, or a
model by path), cold and from L1/L2/L3.

One run, one process, one model object. The prompt is a synthetic document of `--tokens`
tokens, as given (it need not end on a page or chunk boundary), plus a question. Everything
runs in the engine's default mode (`--deterministic`: in deterministic mode):
- cold: the prompt on an empty cache, prefilled in forwards of up to `--chunk-tokens` tokens;
- cold, deterministic: the same prompt on a second engine over the same model and a fresh
  cache (no L3) in deterministic mode, one-page chunks: what the default mode's larger
  forwards gain (`ttft_cold_s` <= 0.6 x `ttft_cold_deterministic_s`);
- hits: the prompt again from L1, from L2 after its L1 pages were evicted, and from L3
  (`file` backend in a temp dir) on a fresh cache with empty L1/L2.
Every request decodes `--new-tokens` greedy tokens (stop tokens do not end it). Each engine
first serves a warm-up prompt of the same length (the main one twice: cold, then as a hit), so
first-call kernel setup inflates no timed figure, and every timed request starts with the
caches quiescent. Each hit is reported next to the cold figure of the same run.

A hit reuses the prompt's whole pages, so `reusable_tokens` is the document rounded down to
whole pages (a hit may reuse more when the question completes a page) and `reused_tokens` is
what each hit took from its own tier (`Output.cached`): the target is every tier reusing all
of `reusable_tokens`. The three hits read the same pages' bytes and compute the same rest in
forwards of the same composition, so `identical` / `logits_identical` compare the L2 and L3
hits with the L1 hit and must hold. `equal_to_cold` (greedy tokens) and `logits_equal_to_cold`
compare the hits with the cold run: figures, not targets, in default mode (the cold run
computes the question inside a larger forward, which can change the logits' last bits).
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any, Callable, NamedTuple

import torch

from kvtier.bench import emit
from kvtier.config import HiCacheConfig
from kvtier.dtypes import name as dtype_name, resolve_here
from kvtier.engine import Engine, Output, SamplingParams
from kvtier.engine.engine import SMOLLM2_NAMESPACE
from kvtier.engine.loader import load_smollm2_model
from kvtier.engine.architectures import build_model
from kvtier.engine.model import PagedLlama
from kvtier.engine.request import pages_for
from kvtier.engine.tokenizer import Tokenizer
from kvtier.errors import ConfigError
from kvtier.cli.flags import add_hicache_flags, config_from_args, refuse_tier_hiding
from kvtier.cli.shared_flags import LOADED_MODEL_ALIASES, add_dtype_flag, add_model_flag
from kvtier.storage_options import EXTRA_CONFIG_FLAG
from kvtier.tiers.hierarchical_cache import HierarchicalCache

HIT_TARGETS = {"l1": 0.10, "l2": 0.15, "l3": 0.25}  # hit TTFT / cold TTFT, at most
COLD_TARGET = 0.6  # default-mode cold TTFT / deterministic cold TTFT, at most
HIT_TIERS = {"l1": "device", "l2": "host", "l3": "storage"}  # the Output.cached field of each
CACHE_DEFAULTS = {"prefetch_policy": "wait_complete"}  # the L3 hit waits for its whole prefix
QUESTION = "\n\nQuestion: what did the sensor in room 3 read in record 12? Answer:"


class PrefixBenchParams(NamedTuple):
    tokens: int = 2000
    dtype: str = "auto"  # a kvtier.dtypes.DType value
    page_size: int = 64
    chunk_tokens: int | None = None  # None: the engine's default
    new_tokens: int = 32
    threads: int | None = None
    deterministic: bool = False
    model: str = "smollm2"  # or a Hugging Face model directory, or a GGUF file
    hicache: tuple[tuple[str, Any], ...] = ()  # SGLang's cache knobs given: (name, value)


class BenchModel(NamedTuple):
    model: PagedLlama
    tokenizer: Tokenizer
    name: str  # the L3 namespace's model part


class KeptBytes(NamedTuple):
    """KV one request left in a cache, per layer kind (a hybrid model's sliding layers are
    kept only for the pages of their windows; a plain model has none)."""

    full_l2: int
    swa_l2: int
    swa_l1: int
    swa_unbounded: int  # what the sliding layers of every page of the request would take


class Runs(NamedTuple):
    cold: Output
    cold_deterministic: Output | None  # None: the main engine is deterministic already
    l1: Output
    l2: Output
    l3: Output
    kept: KeptBytes

    def hits(self) -> dict[str, Output]:
        return {"l1": self.l1, "l2": self.l2, "l3": self.l3}


def load_smollm2(dtype: torch.dtype) -> BenchModel:
    return BenchModel(*load_smollm2_model(dtype), SMOLLM2_NAMESPACE)


def loader(model: str) -> Callable[[torch.dtype], BenchModel]:
    """SmolLM2 for "smollm2", else Gemma-3 270M for "gemma3-270m", else the GGUF file or
    Hugging Face model directory `model`."""
    if model == "smollm2":
        return load_smollm2

    def load_source(dtype: torch.dtype) -> BenchModel:
        from kvtier.actors.rank_actor import namespace_model
        from kvtier.engine.local_model import model_source

        source = model_source(model)
        weights = build_model(source.config(), source.state_dict(), dtype)
        # the namespace ranks serving it would key with (a GGUF's name may hold spaces)
        return BenchModel(weights, source.tokenizer(), namespace_model(source))

    return load_source


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_flag(p, aliases=LOADED_MODEL_ALIASES)
    p.add_argument("--tokens", type=int, default=2000,
                   help="document length in tokens, as given (default 2000)")
    add_dtype_flag(p)
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="most new tokens per forward, a multiple of the page size (default: "
                        "the engine's, kvtier.engine.engine.default_chunk_tokens)")
    p.add_argument("--new-tokens", type=int, default=32,
                   help="greedy tokens per request (stop tokens do not end it)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--deterministic", action="store_true",
                   help="run every engine in deterministic mode (one-page chunks)")
    # SGLang's --hicache-* flags and --hicache-config: the measured engine's cache (the
    # deterministic cold reference keeps the defaults, without L3)
    add_hicache_flags(p, HiCacheConfig(page_size=64, **CACHE_DEFAULTS), {
        "--hicache-storage-backend": "refused: the bench's L3 is a file directory of its own",
        EXTRA_CONFIG_FLAG: "refused: the bench's L3 is a file directory of its own",
        "--disable-hierarchical-cache": "refused: the bench measures L2 and L3 hits",
        "--disable-radix-cache": "refused: the bench measures prefix hits",
        "--hicache-host-mode": "cache (storage_only is refused: the bench measures an L2 hit)"})


def document_tokens(tokenizer, num_tokens: int) -> list[int]:
    """A synthetic sensor log of exactly `num_tokens` tokens (also the demo's document)."""
    lines, ids = [], []
    while len(ids) < num_tokens:
        lines += [f"Record {i}: the sensor in room {i % 17} read {(i * 37) % 101} degrees at "
                  f"{8 + i % 10}:{(i * 7) % 60:02d}; the operator noted nothing unusual."
                  for i in range(len(lines), len(lines) + 64)]
        ids = tokenizer.encode_prompt("Sensor log.\n" + "\n".join(lines))
    return ids[:num_tokens]


def reusable_tokens(document_len: int, page_size: int) -> int:
    """The shared prefix a hit can reuse whatever follows it: the document's whole pages."""
    return document_len // page_size * page_size


def reused_tokens(runs: Runs) -> dict[str, int]:
    """Prompt tokens each hit took from the tier it measures (L1 hit: device, ...)."""
    return {k: getattr(o.cached, HIT_TIERS[k]) for k, o in runs.hits().items()}


def targets(reusable: int, deterministic: bool) -> dict[str, float | int]:
    """The bounds: ratios at most, `reused_tokens_min` at least (in every tier)."""
    bounds: dict[str, float | int] = dict(HIT_TARGETS)
    if not deterministic:  # the comparison is the default mode against deterministic mode
        bounds["cold_vs_deterministic"] = COLD_TARGET
    bounds["reused_tokens_min"] = reusable
    return bounds


def check_targets(bounds: dict[str, float | int], ratios: dict[str, float],
                  reused: dict[str, int]) -> dict[str, bool]:
    """Which bound holds: `ratios` has l1/l2/l3 (and cold_vs_deterministic when bounded)."""
    checks = {k: ratios[k] <= bound for k, bound in bounds.items() if k != "reused_tokens_min"}
    checks["reused_tokens_min"] = all(n >= bounds["reused_tokens_min"] for n in reused.values())
    return checks


def _ttft(engine: Engine, prompt: list[int], params: SamplingParams) -> Output:
    """One timed request, started with the cache quiescent: the previous request's L1->L2
    copies and L2->L3 backups run on background threads and are billed to nobody's TTFT."""
    engine.cache.quiesce()
    (out,) = engine.generate([prompt], params)
    return out


def _engine(bm: BenchModel, config: HiCacheConfig, device_pages: int, chunk_tokens: int | None,
            token_budget: int, deterministic: bool) -> Engine:
    cache = HierarchicalCache(config, bm.model.kv_spec(config.page_size), device_pages,
                              device=bm.model.device, model=bm.name, deterministic=deterministic)
    try:
        return Engine(bm.model, cache, chunk_tokens, token_budget, tokenizer=bm.tokenizer,
                      owns_cache=True, deterministic=deterministic)
    except Exception:
        cache.close()
        raise


def _measure(bm: BenchModel, prompt: list[int], params: PrefixBenchParams,
             l3_dir: str) -> tuple[Runs, int]:
    """The five timed requests (see the module docstring) and the chunk the hits ran."""
    page, det = params.page_size, params.deterministic
    # Stop tokens ignored: every request decodes `new_tokens` tokens, so the decode rate is
    # measured and the hits are compared on all of them (a document cut mid-record may well
    # be answered with an end-of-turn token first).
    greedy = SamplingParams(max_new_tokens=params.new_tokens, stop_token_ids=())
    warm = bm.tokenizer.encode("Warm-up. " * len(prompt))[:len(prompt)]  # no shared prefix
    pages = 4 * pages_for(len(prompt) + params.new_tokens, page)  # warm-up + prompt, twice
    budget = max(8192, 2 * len(prompt))
    config = HiCacheConfig.from_dict({**CACHE_DEFAULTS, **dict(params.hicache), "page_size": page,
                                      "storage_backend": "file",
                                      "storage_options": {"root_dir": l3_dir}})
    with _engine(bm, config, pages, params.chunk_tokens, budget, det) as engine:
        for _ in range(2):  # cold, then a hit: every forward shape the timed requests run
            _ttft(engine, warm, greedy)
        before = _held(engine)
        cold = _ttft(engine, prompt, greedy)
        kept = _kept(engine, before, len(prompt) + params.new_tokens)
        cold_det = None
        if not det:  # no L3: its pages would join the main engine's namespace
            with _engine(bm, HiCacheConfig(page_size=page), pages, None, budget, True) as ref:
                _ttft(ref, warm, greedy)
                cold_det = _ttft(ref, prompt, greedy)
        l1 = _ttft(engine, prompt, greedy)
        engine.cache.flush()  # write-through copies are in L2: evicting L1 demotes
        engine.cache.evict_device(10**9)
        l2 = _ttft(engine, prompt, greedy)
        engine.cache.quiesce()  # the L2 -> L3 backups have landed
        with _engine(bm, config, pages, params.chunk_tokens, budget, det) as fresh:
            l3 = _ttft(fresh, prompt, greedy)
        chunk = engine.runner.chunk_tokens
    return Runs(cold, cold_det, l1, l2, l3, kept), chunk


def _held(engine: Engine) -> tuple[int, int, int]:
    """(L2 pages, L2 sidecar slots, L1 sidecar slots) in use once copies have landed."""
    cache = engine.cache
    cache.flush()
    snap = cache.snapshot()
    return snap.used_host_pages, snap.used_host_sidecar_slots, snap.used_device_sidecar_slots


def _kept(engine: Engine, before: tuple[int, int, int], tokens: int) -> KeptBytes:
    """What the request run since `before` (`tokens` long) left in L1 and L2."""
    spec = engine.cache.spec
    pages, host_slots, device_slots = (a - b for a, b in zip(_held(engine), before))
    side = spec.sidecar.page_bytes if spec.sidecar is not None else 0
    return KeptBytes(pages * spec.page_bytes, host_slots * side, device_slots * side,
                     pages_for(tokens, spec.page_size) * side)


def report(runs: Runs, document_len: int, page_size: int, deterministic: bool) -> dict:
    """The figures and the targets of one run's outputs."""
    cold, hits = runs.cold, runs.hits()
    cold_det = runs.cold_deterministic or cold
    ratios = {k: o.ttft_s / cold.ttft_s for k, o in hits.items()}
    if runs.cold_deterministic is not None:
        ratios["cold_vs_deterministic"] = cold.ttft_s / cold_det.ttft_s
    reusable, reused = reusable_tokens(document_len, page_size), reused_tokens(runs)
    bounds = targets(reusable, deterministic)
    checks = check_targets(bounds, ratios, reused)
    outputs = {"cold": cold, **({"cold_deterministic": runs.cold_deterministic}
                                if runs.cold_deterministic is not None else {}), **hits}
    return {
        "mode": "deterministic" if deterministic else "default",
        "prompt_tokens": len(cold.prompt), "document_tokens": document_len,
        "question_tokens": len(cold.prompt) - document_len, "reusable_tokens": reusable,
        "ttft_cold_s": round(cold.ttft_s, 4),
        "ttft_cold_deterministic_s": round(cold_det.ttft_s, 4),
        **{f"ttft_{k}_s": round(o.ttft_s, 4) for k, o in hits.items()},
        **{f"{k}_ratio": round(r, 4) for k, r in ratios.items()},
        "reused_tokens": reused,
        "identical": all(o.tokens == runs.l1.tokens for o in hits.values()),
        "logits_identical": all(torch.equal(o.prefill_logits, runs.l1.prefill_logits)
                                for o in hits.values()),
        "equal_to_cold": all(o.tokens == cold.tokens for o in hits.values()),
        "logits_equal_to_cold": all(torch.equal(o.prefill_logits, cold.prefill_logits)
                                    for o in hits.values()),
        "decode_tokens_per_s": round(cold.decode_tokens_per_s or 0.0, 2),
        # KV the cold request left in L2 per layer kind (sliding: only its windows' pages),
        # its sliding layers' in L1, and what they would take for every page
        "full_bytes_per_request": runs.kept.full_l2,
        "swa_bytes_per_request": runs.kept.swa_l2,
        "swa_device_bytes_per_request": runs.kept.swa_l1,
        "swa_bytes_without_window_bound": runs.kept.swa_unbounded,
        "targets": bounds, "target_checks": checks, "meets_targets": all(checks.values()),
        "lengths": {k: o.lengths._asdict() for k, o in outputs.items()},
        "cached_tokens": {k: o.cached._asdict() for k, o in hits.items()},
        "answer": cold.text,
    }


def run(params: PrefixBenchParams = PrefixBenchParams(),
        load: Callable[[torch.dtype], BenchModel] = load_smollm2) -> dict:
    """Measure and return the JSON-able result (`load`: the model, SmolLM2 by default)."""
    if params.chunk_tokens is not None and params.chunk_tokens % params.page_size:
        raise ConfigError(f"--chunk-tokens ({params.chunk_tokens}) must be a multiple of "
                          f"--page-size ({params.page_size})")
    if params.tokens < params.page_size:
        raise ConfigError(f"--tokens ({params.tokens}) is below one page ({params.page_size}): "
                          f"a hit would have nothing to reuse; give a longer document")
    if params.threads:
        torch.set_num_threads(params.threads)
    t0 = time.perf_counter()
    bm = load(resolve_here(params.dtype))
    load_s = time.perf_counter() - t0
    prompt = document_tokens(bm.tokenizer, params.tokens) + bm.tokenizer.encode(QUESTION)
    with tempfile.TemporaryDirectory(prefix="kvtier-bench-prefix-") as l3_dir:
        runs, chunk = _measure(bm, prompt, params, l3_dir)
    return {**report(runs, params.tokens, params.page_size, params.deterministic),
            "dtype": dtype_name(bm.model.dtype), "page_size": params.page_size, "chunk_tokens": chunk,
            "new_tokens": params.new_tokens, "device": str(bm.model.device),
            "model": bm.name, "threads": torch.get_num_threads(),
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "model_load_s": round(load_s, 3), "quiescent_between_runs": True,
            **({"hicache": dict(params.hicache)} if params.hicache else {})}


def params_from_args(ns: argparse.Namespace) -> PrefixBenchParams:
    config = config_from_args(ns)  # validates SGLang's flags and the config file
    given = config.explicit or frozenset()
    plain = config.to_dict()
    refuse_tier_hiding(config, "bench prefix")
    for flag, name in (("--hicache-storage-backend", "storage_backend"),
                       (EXTRA_CONFIG_FLAG, "storage_options")):
        if name in given:
            raise ConfigError(f"{flag}: bench prefix's L3 is a file directory of its own; "
                              f"drop it")
    knobs = tuple(sorted((k, plain[k]) for k in given if k != "page_size"))
    return PrefixBenchParams(ns.tokens, ns.dtype, config.page_size, ns.chunk_tokens,
                             ns.new_tokens, ns.threads, ns.deterministic, ns.model, knobs)


def main(ns: argparse.Namespace) -> int:
    params = params_from_args(ns)
    emit(run(params, loader(params.model)), ns.json)
    return 0
