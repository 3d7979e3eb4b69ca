"""Where loading a prefix's KV starts to beat recomputing it, per tier, on this machine.

For each prefix length L (a document of L tokens, a multiple of the page size, then a short
question), `measure_crossover` times TTFT on SmolLM2-135M:

- `cold`: nothing cached, the whole prompt is computed;
- `host`: the document's KV is in L2 only (its L1 pages were evicted): loaded back, then only
  the question is computed;
- `storage`: a second cache with empty L1/L2 over the same `file` L3 directory, after the
  directory's pages were dropped from the OS page cache where possible: L3 read into L2,
  loaded back, then the question.

The cold run computes the whole prompt in one forward pass (an engine whose chunk covers
it: recompute in its fastest form, not handicapped by an extra pass); the hits run on engines
over the same caches whose chunk is L, so a hit reuses exactly the document (hits are reused
down to the chunk grid) and computes the question in one pass. Thresholds are 0 / one page
so that no hit is refused. Kernels are warmed on other tokens of the same shapes first, each timed
request starts with the cache quiescent (as in `kvtier bench prefix`), and every figure is
the best of a few rounds, each on a different document.

The crossover rule (`find_crossover`) takes measured points only, no interpolation: the
smallest measured L from which the hit is faster than cold at L and at every longer measured
L. The true crossing lies between the previous measured length and that one, so the figure is
an upper bound: a threshold set to it never loads where recomputing is faster.
"""
from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import NamedTuple, Sequence

import torch

from kvtier.bench.limits import drop_cached
from kvtier.bench.prefix import QUESTION, document_tokens
from kvtier.config import HiCacheConfig
from kvtier.dtypes import name as dtype_name, resolve_here
from kvtier.engine import Engine, Output, SamplingParams
from kvtier.engine.engine import SMOLLM2_NAMESPACE
from kvtier.engine.loader import load_smollm2_model
from kvtier.engine.request import pages_for
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)

LENGTHS = (64, 128, 256, 512, 1024, 2048)
QUICK_LENGTHS = (64, 128, 256, 512)
ROUNDS, QUICK_ROUNDS = 3, 2
BUDGET_S, QUICK_BUDGET_S = 900.0, 240.0  # longer lengths are skipped once this is spent
PAGE_SIZE = 64
RULE = ("first measured length from which the hit beats cold at it and at every longer "
        "measured length (no interpolation: an upper bound on the true crossing)")
ONE_TOKEN = SamplingParams(max_new_tokens=1)


class CrossoverPoint(NamedTuple):
    """One prefix length: best-of-rounds TTFT in seconds; a hit is None if it did not happen."""

    tokens: int
    cold_s: float
    host_s: float | None
    storage_s: float | None


class Crossover(NamedTuple):
    """Prefix lengths (tokens) from which loading beats recomputing; None: never in range."""

    host_tokens: int | None
    storage_tokens: int | None
    points: tuple[CrossoverPoint, ...]
    dtype: str = "bf16"
    device: str = "cpu"
    skipped: tuple[int, ...] = ()  # lengths not measured: the time budget ran out

    def to_json(self) -> dict:
        return {
            "host_tokens": self.host_tokens, "storage_tokens": self.storage_tokens,
            "points": [{k: (round(v, 5) if isinstance(v, float) else v)
                        for k, v in p._asdict().items()} for p in self.points],
            "dtype": self.dtype, "device": self.device, "skipped": list(self.skipped),
            "rule": RULE, "page_size": PAGE_SIZE,
            "chunk_tokens": "cold: the whole prompt; hits: the prefix length",
            "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2),
        }


def find_crossover(rows: Sequence[tuple[int, float, float | None]]) -> int | None:
    """The smallest length from which `hit_s < cold_s` holds at every longer length, given
    (tokens, cold_s, hit_s) rows in any order; None if the longest row does not win."""
    found = None
    for tokens, cold_s, hit_s in sorted(rows, key=lambda r: r[0], reverse=True):
        if hit_s is None or hit_s >= cold_s:
            break
        found = tokens
    return found


def crossover_from_points(points: Sequence[CrossoverPoint], dtype: str = "bf16",
                          device: str = "cpu", skipped: Sequence[int] = ()) -> Crossover:
    """Both tiers' crossovers from measured points (pure)."""
    host = find_crossover([(p.tokens, p.cold_s, p.host_s) for p in points])
    storage = find_crossover([(p.tokens, p.cold_s, p.storage_s) for p in points])
    return Crossover(host, storage, tuple(sorted(points)), dtype, device, tuple(skipped))


def measure_crossover(quick: bool = False, dtype: str = "auto", *,
                      lengths: Sequence[int] | None = None, rounds: int | None = None,
                      budget_s: float | None = None) -> Crossover:
    """Measure cold vs L2 vs L3 TTFT at a few prefix lengths and find both crossovers.

    Bounded: lengths run shortest first, and once `budget_s` is spent the longer ones are
    skipped (listed in `skipped`). Loads SmolLM2 once; CUDA when present.
    """
    lengths = sorted(lengths or (QUICK_LENGTHS if quick else LENGTHS))
    rounds = rounds or (QUICK_ROUNDS if quick else ROUNDS)
    budget_s = budget_s or (QUICK_BUDGET_S if quick else BUDGET_S)
    if any(n <= 0 or n % PAGE_SIZE for n in lengths):
        raise ValueError(f"prefix lengths must be positive multiples of {PAGE_SIZE}: {lengths}")
    start = time.perf_counter()
    model, tok = load_smollm2_model(resolve_here(dtype))
    dtype = dtype_name(model.dtype)  # the calibration is looked up by the resolved dtype
    points: list[CrossoverPoint] = []
    with tempfile.TemporaryDirectory(prefix="kvtier-crossover-") as l3_dir:
        for i, n in enumerate(lengths):
            if time.perf_counter() - start > budget_s:
                log.warning("crossover: %.0f s budget spent; skipping lengths %s", budget_s,
                            lengths[i:])
                return crossover_from_points(points, dtype, str(model.device), lengths[i:])
            points.append(_measure_length(model, tok, n, rounds, os.path.join(l3_dir, str(n))))
            log.info("crossover: %s", points[-1])
    return crossover_from_points(points, dtype, str(model.device))


def _measure_length(model, tok, n: int, rounds: int, l3_dir: str) -> CrossoverPoint:
    question = tok.encode(QUESTION)
    total = n + len(question)
    config = HiCacheConfig(page_size=PAGE_SIZE, storage_backend="file",
                           storage_options={"root_dir": l3_dir}, prefetch_policy="wait_complete",
                           load_back_threshold_tokens=0, prefetch_threshold_tokens=PAGE_SIZE)
    device_pages = 3 * pages_for(total + 1, PAGE_SIZE)
    budget = max(8192, 2 * total)
    caches = [HierarchicalCache(config, model.kv_spec(PAGE_SIZE), device_pages,
                                device=model.device, model=SMOLLM2_NAMESPACE) for _ in range(2)]
    cold = host = storage = float("inf")
    one_pass = pages_for(total, PAGE_SIZE) * PAGE_SIZE
    with Engine(model, caches[0], n, budget, tokenizer=tok, owns_cache=True) as engine, \
            Engine(model, caches[1], n, budget, tokenizer=tok, owns_cache=True) as fresh, \
            Engine(model, caches[0], one_pass, budget, tokenizer=tok) as whole:  # cold: 1 pass
        warm = tok.encode("Warm-up. " * total)[:n] + question
        _ttft(whole, warm)  # the cold shape (the whole prompt) ...
        _ttft(engine, warm)  # ... and the hit's (the question after n cached tokens)
        for r in range(rounds):
            prompt = (tok.encode(f"Log {r}.\n") + document_tokens(tok, n))[:n] + question
            cold = min(cold, _ttft(whole, prompt).ttft_s)
            engine.cache.flush()  # write-through copies are in L2: evicting L1 demotes
            engine.cache.evict_device(10**9)
            host = min(host, _hit_s(_ttft(engine, prompt), "host", n))
            engine.cache.quiesce()  # the L2 -> L3 backups have landed
            _drop_dir_cached(l3_dir)
            storage = min(storage, _hit_s(_ttft(fresh, prompt), "storage", n))
    return CrossoverPoint(n, cold, _finite(host), _finite(storage))


def _ttft(engine: Engine, prompt: list[int]) -> Output:
    """One request, started with the cache quiescent (background copies billed to nobody)."""
    engine.cache.quiesce()
    (out,) = engine.generate([prompt], ONE_TOKEN)
    return out


def _hit_s(out: Output, tier: str, n: int) -> float:
    """The TTFT of a hit that reused all `n` prefix tokens from `tier`; inf if it did not."""
    got = getattr(out.cached, tier)
    if got < n:
        log.warning("crossover: a %s hit reused %d of %d tokens (%s); not counted", tier,
                    got, n, out.cached)
        return float("inf")
    return out.ttft_s


def _finite(seconds: float) -> float | None:
    return None if seconds == float("inf") else seconds


def _drop_dir_cached(directory: str) -> None:
    """Best effort: make the next L3 read come from the device, not the page cache."""
    for root, _, files in os.walk(directory):
        for name in files:
            drop_cached(os.path.join(root, name))
