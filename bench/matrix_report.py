"""The matrix's numbers: one cell per workload x configuration x round, and the report files
(results.json, results.md, three PNG plots) written from the cells.

Bytes moved, by tier: `device` = tokens reused from L1 x KV bytes per token (an L1 hit moves
nothing, it is read in place: this is the KV the hit spared); `host` = L1<->L2 copies that
landed (the controller's TransferStats, write + load); `storage` = L2<->L3 bytes (the backend's
BackendStats, written + read).
"""
from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Iterable, NamedTuple, Sequence

TIERS = ("device", "host", "storage")
GB = 1e9


class TierSnapshot(NamedTuple):
    """Monotonic byte and second counters of one or more caches, taken between requests."""

    host_write_bytes: int = 0
    host_load_bytes: int = 0
    host_load_s: float = 0.0
    storage_write_bytes: int = 0
    storage_read_bytes: int = 0
    storage_write_s: float = 0.0  # inside the backend's set_from calls
    storage_read_s: float = 0.0  # inside the backend's get_into calls
    prefetch_wait_s: float = 0.0  # StorageCounters: prefetch submit -> finish, per request


def snapshot_sum(snaps: Iterable[TierSnapshot]) -> TierSnapshot:
    return TierSnapshot(*(sum(col) for col in zip(TierSnapshot(), *snaps)))


def snapshot_diff(after: TierSnapshot, before: TierSnapshot) -> TierSnapshot:
    return TierSnapshot(*(a - b for a, b in zip(after, before)))


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 1]); 0.0 for no values."""
    xs = sorted(values)
    if not xs:
        return 0.0
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _rate_gb_s(nbytes: float, seconds: float) -> float | None:
    return round(nbytes / seconds / GB, 3) if seconds > 0 and nbytes > 0 else None


def make_cell(workload: str, config: int, round_no: int, outputs: Sequence,
              moved: TierSnapshot, token_bytes: int, timeout_s: float | None = None,
              label: str = "") -> dict:
    """One cell from a round's outputs (each with `ttft_s`, `decode_tokens_per_s`, `cached`
    (device, host, storage tokens) and `prompt`) and the counters' change over the round."""
    ttfts = [o.ttft_s for o in outputs if o.ttft_s is not None]
    rates = [o.decode_tokens_per_s for o in outputs if o.decode_tokens_per_s]
    hits = {t: sum(getattr(o.cached, t) for o in outputs) for t in TIERS}
    return {
        "workload": workload, "config": config, "round": round_no, "timeout_s": timeout_s,
        "label": label, "requests": len(outputs),
        "prompt_tokens": sum(len(o.prompt) for o in outputs),
        "ttft_mean_s": round(sum(ttfts) / len(ttfts), 4) if ttfts else 0.0,
        "ttft_p90_s": round(percentile(ttfts, 0.9), 4),
        "decode_tokens_per_s": round(sum(rates) / len(rates), 2) if rates else 0.0,
        "hit_tokens": hits,
        "bytes_moved": {"device": hits["device"] * token_bytes,
                        "host": moved.host_write_bytes + moved.host_load_bytes,
                        "storage": moved.storage_write_bytes + moved.storage_read_bytes},
        "bytes_detail": {"host_write": moved.host_write_bytes, "host_load": moved.host_load_bytes,
                         "storage_write": moved.storage_write_bytes,
                         "storage_read": moved.storage_read_bytes},
        "achieved_gb_s": {"host_load": _rate_gb_s(moved.host_load_bytes, moved.host_load_s),
                          "storage_read": _rate_gb_s(moved.storage_read_bytes,
                                                     moved.storage_read_s),
                          "storage_write": _rate_gb_s(moved.storage_write_bytes,
                                                      moved.storage_write_s)},
        "prefetch_wait_s": round(moved.prefetch_wait_s, 4),
        "_seconds": {"host_load": moved.host_load_s, "storage_read": moved.storage_read_s,
                     "storage_write": moved.storage_write_s},
    }


def column_key(cell: dict) -> str:
    return str(cell["config"]) if cell.get("timeout_s") is None else f"5@{cell['timeout_s']:g}s"


def _columns(cells: Sequence[dict]) -> list[str]:
    keys = {column_key(c): (c["config"], c.get("timeout_s") or 0.0) for c in cells}
    return sorted(keys, key=keys.__getitem__)


def _ceiling(limits: dict, words: Sequence[str]) -> tuple[str, float] | None:
    """The first limits entry whose name contains one of `words` (in the order of `words`)."""
    for word in words:
        for name, value in limits.items():
            if (word in name and isinstance(value, (int, float)) and not isinstance(value, bool)
                    and value > 0):
                return name, float(value)
    return None


# Which `kvtier.bench.limits` figure bounds each tier (pinned H2D exists only under CUDA).
CEILINGS = {"host_load": ("pinned_h2d", "memory_copy", "memcpy", "copy"),
            "storage_read": ("file_read", "storage_read", "read"),
            "storage_write": ("file_write", "storage_write", "write")}


def tier_fractions(cells: Sequence[dict], limits: dict) -> dict:
    """Each tier's achieved GB/s over all cells, next to its ceiling from `limits`."""
    out = {}
    memory = _ceiling(limits or {}, CEILINGS["host_load"])
    for name, words in CEILINGS.items():
        nbytes = sum(c["bytes_detail"][name] for c in cells)
        seconds = sum(c.get("_seconds", {}).get(name, 0.0) for c in cells)
        achieved = _rate_gb_s(nbytes, seconds)
        ceiling = _ceiling(limits or {}, words)
        out[name] = {"achieved_gb_s": achieved, "ceiling": ceiling[0] if ceiling else None,
                     "ceiling_gb_s": ceiling[1] if ceiling else None,
                     "fraction": _fraction(achieved, ceiling),
                     # above 1 vs the file ceiling: L3 ran from the OS page cache
                     "fraction_of_memory_copy": _fraction(achieved, memory)}
    return out


def _fraction(achieved: float | None, ceiling: tuple[str, float] | None) -> float | None:
    return round(achieved / ceiling[1], 3) if achieved and ceiling else None


def markdown_table(cells: Sequence[dict], round_no: int = 2) -> str:
    """TTFT of `round_no` per workload (rows) x configuration (columns), with the ratio to
    configuration 0 of the same workload."""
    cols = _columns(cells)
    by = {(c["workload"], column_key(c)): c for c in cells if c["round"] == round_no}
    lines = ["| workload | " + " | ".join(f"cfg {k}" for k in cols) + " |",
             "|---|" + "---:|" * len(cols)]
    for w in sorted({c["workload"] for c in cells}):
        base = by.get((w, "0"))
        row = []
        for k in cols:
            cell = by.get((w, k))
            if cell is None:
                row.append("–")
                continue
            ms = f"{cell['ttft_mean_s'] * 1000:.0f} ms"
            if base and base["ttft_mean_s"] > 0:
                ms += f" ({cell['ttft_mean_s'] / base['ttft_mean_s']:.2f}×)"
            row.append(ms)
        lines.append(f"| {w} | " + " | ".join(row) + " |")
    return "\n".join(lines)


NO_REUSE_TARGET = 1.05  # workload E: median TTFT over configurations 1-5, both rounds, / cfg 0
BEST_EFFORT_TARGET = 1.05  # configuration 3's round 2 / configuration 0's round 1 (cold)
BEST_EFFORT_WORKLOADS = ("A", "B", "D")


def targets(cells: Sequence[dict]) -> dict:
    """The matrix's bounds, from the cells it ran (a bound whose cells are missing is None):
    - `no_reuse_median_ratio`: on E, the median over configurations 1-5 and both rounds of
      each cell's mean TTFT / configuration 0's of the same round: what the hierarchy costs
      when nothing is reused (at most 1.05);
    - `best_effort_vs_cold`: per workload A, B, D, configuration 3 (best_effort) round 2 /
      configuration 0 round 1: best_effort never costs more than recomputing (at most 1.05).
    """
    by = {(c["workload"], column_key(c), c["round"]): c["ttft_mean_s"] for c in cells}
    ratios = [t / by[("E", "0", r)] for (w, k, r), t in by.items()
              if w == "E" and k != "0" and by.get(("E", "0", r))]
    median = statistics.median(ratios) if ratios else None
    best = {w: round(by[(w, "3", 2)] / by[(w, "0", 1)], 3) for w in BEST_EFFORT_WORKLOADS
            if by.get((w, "3", 2)) is not None and by.get((w, "0", 1))}
    checks = {"no_reuse": None if median is None else median <= NO_REUSE_TARGET,
              "best_effort": (all(r <= BEST_EFFORT_TARGET for r in best.values())
                              if len(best) == len(BEST_EFFORT_WORKLOADS) else None)}
    return {"no_reuse_median_ratio": None if median is None else round(median, 3),
            "no_reuse_cells": len(ratios), "best_effort_vs_cold": best,
            "bounds": {"no_reuse_median_ratio": NO_REUSE_TARGET,
                       "best_effort_vs_cold": BEST_EFFORT_TARGET},
            "checks": checks}


def _machine_line(m: dict) -> str:
    gpu = m.get("device", "cuda") if m.get("cuda") else "no GPU"
    return (f"{m.get('cores')} cores, {m.get('ram_gib')} GiB, {gpu}, torch {m.get('torch')}, "
            f"load avg {m.get('load_avg_1m')}")


def markdown_report(result: dict) -> str:
    cells = result["cells"]
    parts = [f"# kvtier experiment matrix ({'quick' if result.get('quick') else 'full'})", "",
             f"Date: {result.get('date', '')}. Machine: {_machine_line(result.get('machine', {}))}."
             f" Wall time: {result.get('wall_s', {})}.", "",
             "## Round-2 TTFT (mean) per workload x configuration, ratio to configuration 0",
             "", markdown_table(cells, 2), "",
             "## Round-1 TTFT (cache being built)", "", markdown_table(cells, 1), "",
             "## Tier bandwidth vs ceiling", "",
             "| tier | achieved GB/s | ceiling | ceiling GB/s | fraction | of memory copy |",
             "|---|---:|---|---:|---:|---:|"]
    for name, f in tier_fractions(cells, result.get("limits") or {}).items():
        parts.append(f"| {name} | {f['achieved_gb_s']} | {f['ceiling']} | {f['ceiling_gb_s']} "
                     f"| {f['fraction']} | {f['fraction_of_memory_copy']} |")
    parts += ["", f"Crossover tokens (reuse beats recompute from): "
                  f"{json.dumps(result.get('crossover_tokens'))}", ""]
    t = targets(cells)
    parts += ["## Targets", "",
              f"- No reuse (E): median TTFT of configurations 1-5 over both rounds / "
              f"configuration 0: {t['no_reuse_median_ratio']} over {t['no_reuse_cells']} cells "
              f"(at most {NO_REUSE_TARGET}: {t['checks']['no_reuse']})",
              f"- best_effort round 2 / cold round 1 (configuration 3 / 0): "
              f"{json.dumps(t['best_effort_vs_cold'])} (each at most {BEST_EFFORT_TARGET}: "
              f"{t['checks']['best_effort']})", ""]
    return "\n".join(parts)


def write_report(out_dir: str | os.PathLike, result: dict) -> list[Path]:
    """Write results.json, results.md and the plots into `out_dir`; the paths written."""
    from kvtier.bench.matrix_plots import write_plots

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    public = dict(result, cells=[{k: v for k, v in c.items() if not k.startswith("_")}
                                 for c in result["cells"]])
    public["tier_fractions"] = tier_fractions(result["cells"], result.get("limits") or {})
    public["targets"] = targets(result["cells"])
    (out / "results.json").write_text(json.dumps(public, indent=1) + "\n")
    (out / "results.md").write_text(markdown_report(result))
    return [out / "results.json", out / "results.md", *write_plots(out, result["cells"])]
