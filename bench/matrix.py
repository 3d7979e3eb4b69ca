"""`kvtier bench matrix`: the seed's experiment matrix on SmolLM2 (CPU or CUDA), one process;
`--model DIR` runs it on a Hugging Face model directory instead (with --skip-limits).

Workloads A..E (`matrix_workloads`) x configurations 0..5 (5 once per prefetch timeout), two
rounds each, every request timed alone with the caches quiescent (queued L1->L2 copies and
L2->L3 backups landed first, billed to nobody's TTFT). One model is loaded and shared; each
workload x configuration gets fresh caches (one per instance; D has several, all on ONE
`file` L3 directory) and a fresh L3 directory. A workload's configurations run side by side,
turn by turn in a rotating order (`run_workload`), so every ratio to configuration 0 compares
requests run seconds apart on this shared machine, not minutes.

Between round 1 and round 2:
- configurations 0, 1, 2 keep their L1 and L2: round 2 hits what round 1 left there;
- configurations 3, 4, 5 drop, on every instance, all unlocked L1 pages
  (`cache.evict_device(all)`, after `flush` and `storage.drain`) and then all L2 pages
  (`cache.drop_unlocked()`), as `Rank.drop_cache` does; L3 is kept, so round 2's
  reuse comes from L3 (prefetch L3->L2, then load-back L2->L1) under the column's policy.

Before the matrix it measures the tiers' ceilings (`kvtier.bench.limits`) and the reuse
crossover (`kvtier.bench.crossover`, saved with `kvtier.calibration.save_calibration`);
`--skip-limits` leaves both out. Results: see `matrix_report` and docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shutil
import sys
import tempfile
import time
from typing import Callable, NamedTuple, Sequence

import torch

from kvtier.bench.matrix_report import (TierSnapshot, make_cell, markdown_table, snapshot_diff,
                                        snapshot_sum, write_report)
from kvtier.bench.matrix_workloads import (FULL, QUICK, MatrixConfig, MatrixSizes, Workload,
                                           build_workloads, filler_tokens, hicache_config,
                                           matrix_configs)
from kvtier.cli.shared_flags import LOADED_MODEL_ALIASES, add_dtype_flag, add_model_flag
from kvtier.dtypes import name as dtype_name, resolve_here
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.engine import SMOLLM2_NAMESPACE
from kvtier.engine.request import pages_for
from kvtier.errors import ConfigError
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.host_pool import available_host_bytes



class MatrixParams(NamedTuple):
    out: str
    quick: bool = False
    dtype: str = "auto"  # a kvtier.dtypes.DType value
    workloads: str = "ABCDE"
    configs: tuple[int, ...] = (0, 1, 2, 3, 4, 5)
    skip_limits: bool = False
    progress: bool = True
    threads: int | None = None
    model: str = "smollm2"  # or a Hugging Face model directory (kvtier.bench.prefix.loader)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True, help="directory for results.json, results.md, PNGs")
    p.add_argument("--quick", action="store_true",
                   help="small documents, few requests, two timeouts (~10 min on 2 cores)")
    p.add_argument("--json", action="store_true", help="print results.json's object, no bars")
    add_dtype_flag(p)
    p.add_argument("--workloads", default="ABCDE", help="subset of ABCDE (default all)")
    p.add_argument("--configs", default="012345", help="subset of 012345 (default all)")
    p.add_argument("--skip-limits", action="store_true",
                   help="do not measure tier ceilings and the crossover")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_model_flag(p, aliases=LOADED_MODEL_ALIASES,
                   note="; any but smollm2 with --skip-limits: the ceilings and crossover "
                        "calibrate SmolLM2")


# ---- ceilings -------------------------------------------------------------------------------
def measure_ceilings(l3_dir: str, quick: bool, dtype: str) -> tuple[dict, dict, dict]:
    """(limits GB/s, crossover tokens by tier, crossover's own JSON); imported here so this
    module works before those modules exist."""
    try:
        from kvtier.bench.crossover import measure_crossover
        from kvtier.bench.limits import measure_limits
        from kvtier.calibration import save_calibration
    except ImportError as error:
        raise ConfigError(f"cannot measure the tier ceilings ({error}); pass --skip-limits "
                          "to run the matrix without them") from error

    limits = measure_limits(l3_dir, quick)
    crossover = measure_crossover(quick, dtype)
    save_calibration(crossover)
    tokens = {"host": crossover.host_tokens, "storage": crossover.storage_tokens}
    return limits.to_json(), tokens, crossover.to_json()


# ---- one workload x configuration -----------------------------------------------------------
def _snapshot(cache: HierarchicalCache) -> TierSnapshot:
    """The cache's transfer figures now; L3's seconds are the backend's own time inside its
    reads and writes (BackendStats)."""
    snap = cache.snapshot()
    t = snap.transfers
    if snap.l3 is None:
        return TierSnapshot(t.write_bytes, t.load_bytes, t.load_s)
    b = snap.l3.backend
    return TierSnapshot(t.write_bytes, t.load_bytes, t.load_s, b.bytes_written, b.bytes_read,
                        b.write_s, b.read_s, snap.l3.counters.prefetch_wait_s)


def quiesce(caches: Sequence[HierarchicalCache]) -> None:
    for cache in caches:
        cache.quiesce()


def drop_l1_l2(cache: HierarchicalCache) -> None:
    """Evict every unlocked L1 page, then every L2 page (L3 stays)."""
    quiesce([cache])
    cache.drop_unlocked()


class _Column:
    """One configuration of one workload: its engines (one per instance, fresh caches on one
    L3 directory)."""

    def __init__(self, stack: contextlib.ExitStack, model, tokenizer, workload: Workload,
                 mc: MatrixConfig, sizes: MatrixSizes, l3_dir: str | None,
                 name: str = SMOLLM2_NAMESPACE) -> None:
        self.mc = mc
        config = hicache_config(mc, sizes.page_size, l3_dir)
        self.engines = []
        for _ in range(workload.instances):
            cache = HierarchicalCache(config, model.kv_spec(sizes.page_size), workload.device_pages,
                                      device=model.device, model=name)
            self.engines.append(stack.enter_context(Engine(model, cache, sizes.chunk_tokens,
                                                           tokenizer=tokenizer, owns_cache=True)))
        self.caches = [e.cache for e in self.engines]

    def snapshot(self) -> TierSnapshot:
        return snapshot_sum(map(_snapshot, self.caches))


def turn_order(num_columns: int, step: int) -> list[int]:
    """The columns' order for the `step`-th turn of a workload: rotated by one each turn, so
    no configuration always runs first (right after the others' copies were flushed)."""
    k = step % num_columns
    return list(range(k, num_columns)) + list(range(k))


def pool_bytes(workload: Workload, mc: MatrixConfig, sizes: MatrixSizes, page_bytes: int) -> int:
    """L1 + L2 bytes one configuration's caches hold for `workload` (every instance)."""
    config = hicache_config(mc, sizes.page_size, "/unused" if mc.has_l3 else None)
    device = workload.device_pages * page_bytes
    host = config.host_pool_bytes(device) if config.enable_hierarchical_cache else 0
    return workload.instances * (device + host)


def side_by_side(need_bytes: Sequence[int], budget_bytes: int | None) -> list[list[int]]:
    """Consecutive groups of columns whose pools fit in `budget_bytes` together (None: one
    group); a group runs side by side, the groups one after another."""
    groups: list[list[int]] = []
    used = 0
    for i, need in enumerate(need_bytes):
        if not groups or (budget_bytes is not None and used + need > budget_bytes):
            groups.append([])
            used = 0
        groups[-1].append(i)
        used += need
    return groups


def run_workload(model, tokenizer, workload: Workload, configs: Sequence[MatrixConfig],
                 sizes: MatrixSizes, tmp_dir: str,
                 after_request: Callable[[], None] = lambda: None,
                 budget_bytes: int | None = None, name: str = SMOLLM2_NAMESPACE) -> list[dict]:
    """Both rounds of one workload under every configuration; two cells per configuration,
    in configuration order. Configurations run side by side (`run_side_by_side`) in as few
    groups as `budget_bytes` of pools allows (None: all at once). `name`: the model part of
    the caches' key namespace."""
    page_bytes = model.kv_spec(sizes.page_size).page_bytes
    need = [pool_bytes(workload, mc, sizes, page_bytes) for mc in configs]
    cells: list[dict] = []
    for group in side_by_side(need, budget_bytes):
        cells += run_side_by_side(model, tokenizer, workload, [configs[i] for i in group],
                                  sizes, tmp_dir, after_request, name)
    return cells


def run_side_by_side(model, tokenizer, workload: Workload, configs: Sequence[MatrixConfig],
                     sizes: MatrixSizes, tmp_dir: str,
                     after_request: Callable[[], None] = lambda: None,
                     name: str = SMOLLM2_NAMESPACE) -> list[dict]:
    """Both rounds of one workload under `configs`, side by side, turn by turn: each has its
    own fresh caches (and L3 directory), and turn t of every configuration runs before turn
    t + 1 of any, in a rotating order.

    Why: on a shared machine the load drifts over minutes, and a configuration measured
    minutes after configuration 0 read that drift as its own overhead. Side by side, every
    ratio to configuration 0 compares requests run seconds apart.
    """
    greedy = SamplingParams(max_new_tokens=sizes.new_tokens)
    with contextlib.ExitStack() as stack:
        columns = [_Column(stack, model, tokenizer, workload, mc, sizes,
                           tempfile.mkdtemp(dir=tmp_dir) if mc.has_l3 else None, name)
                   for mc in configs]
        every = [cache for col in columns for cache in col.caches]
        rounds: list[list[dict]] = [[] for _ in columns]
        step = 0
        for round_no, turns in enumerate(workload.rounds, 1):
            for col in columns:
                if round_no == 2 and col.mc.has_l3:
                    for cache in col.caches:
                        drop_l1_l2(cache)
            quiesce(every)
            before = [col.snapshot() for col in columns]
            outputs: list[list] = [[] for _ in columns]
            for turn in turns:
                for i in turn_order(len(columns), step):
                    quiesce(every)
                    engine = columns[i].engines[turn.instance]
                    outputs[i] += engine.generate([list(turn.tokens)], greedy)
                    after_request()
                step += 1
            quiesce(every)
            load = round(os.getloadavg()[0], 2)  # the machine is shared
            for i, col in enumerate(columns):
                moved = snapshot_diff(col.snapshot(), before[i])
                cell = make_cell(workload.name, col.mc.config, round_no, outputs[i], moved,
                                 col.caches[0].spec.token_bytes, col.mc.timeout_s, col.mc.label)
                rounds[i].append(dict(cell, load_avg_1m=load))
    return [cell for cells in rounds for cell in cells]


def _warm_up(model, tokenizer, sizes: MatrixSizes, num_tokens: int) -> None:
    """First-call setup billed to no cell: kernels on every chunk and attention shape up to a
    `num_tokens` prompt (the longest the run has), and the allocator's heap grown to what such
    a prefill needs. Warmed on one chunk only, the first request of the run (configuration
    0's, the denominator of every ratio) paid the rest."""
    num_tokens = max(num_tokens, sizes.chunk_tokens + 1)
    pages = pages_for(num_tokens + sizes.new_tokens, sizes.page_size) + 2
    cache = HierarchicalCache(hicache_config(MatrixConfig(0, "warm-up"), sizes.page_size, None),
                              model.kv_spec(sizes.page_size), pages, device=model.device)
    with Engine(model, cache, sizes.chunk_tokens, tokenizer=tokenizer, owns_cache=True) as e:
        ids = filler_tokens(tokenizer.encode, num_tokens, topic=999)
        e.generate([ids], SamplingParams(max_new_tokens=sizes.new_tokens))


# ---- the whole run --------------------------------------------------------------------------
def machine() -> dict:
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 0
    return {"cores": os.cpu_count(), "ram_gib": round(ram / 2**30, 1),
            "torch": torch.__version__, "cuda": torch.cuda.is_available(),
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2)}


def run(params: MatrixParams) -> dict:
    """Measure everything, write the report into `params.out`, return the result."""
    from kvtier.bench.prefix import loader
    from tqdm import tqdm

    if params.model != "smollm2" and not params.skip_limits:
        raise ConfigError(f"--model {params.model}: the tier ceilings and the crossover "
                          f"calibrate SmolLM2 (kvtier serve's thresholds); add --skip-limits")
    if params.threads:
        torch.set_num_threads(params.threads)
    t_start = time.perf_counter()
    sizes = QUICK if params.quick else FULL
    phases: dict[str, float] = {}
    limits: dict = {}
    crossover_tokens: dict = {"host": None, "storage": None}
    extra: dict = {"limits_skipped": params.skip_limits}
    with tempfile.TemporaryDirectory(prefix="kvtier-matrix-") as tmp:
        if not params.skip_limits:
            t0 = time.perf_counter()
            limits, crossover_tokens, extra["crossover"] = measure_ceilings(
                tmp, params.quick, params.dtype)
            phases["limits_and_crossover_s"] = round(time.perf_counter() - t0, 1)
        t0 = time.perf_counter()
        bm = loader(params.model)(resolve_here(params.dtype))
        model, tok = bm.model, bm.tokenizer
        workloads = [w for w in build_workloads(tok.encode, sizes) if w.name in params.workloads]
        configs = [c for c in matrix_configs(sizes.timeouts_s) if c.config in params.configs]
        _warm_up(model, tok, sizes, max(len(t.tokens) for w in workloads for r in w.rounds for t in r))
        total = len(configs) * sum(len(t) for w in workloads for t in w.rounds)
        bar = tqdm(total=total, unit="req", desc="matrix", file=sys.stderr,
                   disable=not params.progress)
        cells: list[dict] = []
        available = available_host_bytes()
        budget = None if available is None else available // 2  # the machine is shared
        for w in workloads:
            bar.set_postfix_str(w.name)
            w_dir = tempfile.mkdtemp(dir=tmp)
            cells += run_workload(model, tok, w, configs, sizes, w_dir, lambda: bar.update(1),
                                  budget, bm.name)
            shutil.rmtree(w_dir, ignore_errors=True)
        bar.close()
        phases["matrix_s"] = round(time.perf_counter() - t0, 1)
    phases["total_s"] = round(time.perf_counter() - t_start, 1)
    result = {
        "cells": cells, "limits": limits, "crossover_tokens": crossover_tokens,
        "machine": machine(), "quick": params.quick,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "sizes": sizes._asdict(), "dtype": dtype_name(resolve_here(params.dtype)), "wall_s": phases,
        "workloads": {w.name: {"title": w.title, "device_pages": w.device_pages,
                               "instances": w.instances,
                               "requests_per_round": [len(r) for r in w.rounds]}
                      for w in workloads},
        "configs": {c.key: c.label for c in configs}, **extra,
        **({"model": bm.name} if params.model != "smollm2" else {}),
    }
    write_report(params.out, result)
    return result


def main(ns: argparse.Namespace) -> int:
    import json

    params = MatrixParams(ns.out, ns.quick, ns.dtype, ns.workloads.upper(),
                          tuple(int(c) for c in ns.configs), ns.skip_limits, not ns.json,
                          ns.threads, ns.model)
    result = run(params)
    if ns.json:
        with open(os.path.join(ns.out, "results.json"), encoding="utf-8") as fh:
            print(json.dumps(json.load(fh)))
    else:
        print(markdown_table(result["cells"], 2))
        print(f"wrote {ns.out}/results.json, results.md and 3 PNGs in {result['wall_s']}")
    return 0
