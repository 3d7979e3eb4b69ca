"""The report of `kvtier demo` (and `kvtier bench instances`): the demo's per-request rows,
its table, the summary JSON and the agreement/call-overhead figures in it.

It reads what the demo measured (engine Outputs, rank stats, the driver's call times) and
computes nothing on a cluster, so it imports no engine, actor or Ray module.
"""
from __future__ import annotations

import statistics
from typing import Any, NamedTuple

from kvtier.dtypes import name as dtype_name, resolve_here


class Row(NamedTuple):
    instance: str
    question: int
    expected: str
    out: Any  # kvtier.engine.Output of the cached run
    cold: Any  # Output of the cold run of the same prompt
    text: str = ""  # the answer, decoded
    # L3 bytes this request's ranks read and the longest time a rank spent reading them (of
    # the fastest try, when the request was asked again: `again`, `l3_read_tries_s`)
    l3_read: tuple[int, float] | None = None
    again: tuple = ()  # Outputs of the same request asked again, L1 and L2 dropped first
    l3_read_tries_s: tuple[float, ...] = ()  # each try's longest rank time reading L3

    @property
    def tier(self) -> str:
        c = self.out.cached
        hits = {"L1": c.device, "L2": c.host, "L3": c.storage}
        best = max(hits, key=hits.get)
        return best if hits[best] else "compute"

    @property
    def identical(self) -> bool:
        return all(o.tokens == self.cold.tokens for o in (self.out, *self.again))

    @property
    def ratio(self) -> float:
        return self.out.ttft_s / self.cold.ttft_s

    def to_json(self) -> dict:
        return {"instance": self.instance, "question": self.question, "tier": self.tier,
                "expected_tier": self.expected, "lengths": self.out.lengths._asdict(),
                "cached": self.out.cached._asdict(), "ttft_s": round(self.out.ttft_s, 4),
                "ttft_cold_s": round(self.cold.ttft_s, 4), "ratio": round(self.ratio, 4),
                "identical": self.identical, "answer": self.text,
                **({"l3_read_bytes": self.l3_read[0], "l3_read_s": round(self.l3_read[1], 5)}
                   if self.l3_read else {}),
                **({"l3_read_tries_s": [round(t, 5) for t in self.l3_read_tries_s]}
                   if self.l3_read_tries_s else {})}


def summary(params: Any, rows: list[Row], stats: dict, calls: dict, doc_len: int,
            prompts: list, runtime_s: float) -> dict:
    """The demo's JSON line. `params` is the run's kvtier.cli.demo.DemoParams; `stats` maps each
    instance to its ranks' stats, `calls` to (driver's step-call seconds, requests submitted)."""
    by_tier = {r.tier: r for r in rows}
    colds = {r.question: r.cold.ttft_s for r in rows}
    result: dict[str, Any] = {
        "identical": all(r.identical for r in rows),
        "ttft_cold_s": round(statistics.mean(colds.values()), 4),
        "ttft_l1_ratio": round(by_tier["L1"].ratio, 4) if "L1" in by_tier else None,
        "ttft_l2_ratio": round(by_tier["L2"].ratio, 4) if "L2" in by_tier else None,
        "ttft_l3_cross_instance_ratio": round(by_tier["L3"].ratio, 4) if "L3" in by_tier
        else None,
        "tiers_as_expected": all(r.tier == r.expected for r in rows),
        "l3_read_gbps": l3_read_gbps(rows),
    }
    result.update(agreement_figures([s for per in stats.values() for s in per]))
    result.update(call_overhead(stats, calls))
    result.update({
        "l3": params.l3, "tp_size": params.tp_size, "document_tokens": doc_len,
        "prompt_tokens": [len(p) for p in prompts], "new_tokens": params.new_tokens,
        "page_size": params.page_size, "chunk_tokens": params.chunk_tokens,
        "dtype": params.dtype, "dtype_resolved": dtype_name(resolve_here(params.dtype)),
        "steps": {n: sum(s.steps for s in per) for n, per in stats.items()},
        "requests": [r.to_json() for r in rows], "runtime_s": round(runtime_s, 1),
    })
    return result


def l3_read_gbps(rows: list[Row]) -> float | None:
    """GB/s of the L3 reads of the requests that hit L3: every rank's bytes over the longest
    time one rank spent reading (the ranks read at the same time); of a request asked
    several times, its fastest try."""
    reads = [r.l3_read for r in rows if r.l3_read and r.l3_read[1] > 0]
    if not reads:
        return None
    return round(sum(b for b, _ in reads) / sum(s for _, s in reads) / 1e9, 3)


def agreement_figures(ranks: list) -> dict:
    """One agreement round per step, its time per round (every rank's recent rounds pooled).
    TP=1 ranks agree with themselves, without a collective: they count none."""
    multi = [s for s in ranks if s.size > 1]
    if not multi:
        return {"collectives_per_step": 0.0, "agreement_us_p50": None, "agreement_us_p99": None,
                "agreement_note": "TP=1: ranks agree locally, no collective runs"}
    rounds, steps = sum(s.agreement_rounds for s in multi), sum(s.steps for s in multi)
    times = sorted(t for s in multi for t in s.agreement_recent_s)
    return {"collectives_per_step": round(rounds / max(steps, 1), 3),
            "agreement_us_p50": round(1e6 * _quantile(times, 0.50), 1),
            "agreement_us_p99": round(1e6 * _quantile(times, 0.99), 1),
            "agreement_us_mean": round(1e6 * sum(s.agreement_s for s in multi)
                                       / max(rounds, 1), 1)}


def call_overhead(stats: dict, calls: dict) -> dict:
    """The driver's time in step calls that no rank spent stepping (Ray calls, transfers of
    the outputs, lockstep waits), per step and per request, summed over the instances."""
    extra_s = steps = requests = 0
    for name, ranks in stats.items():
        call_s, submitted = calls[name]
        extra_s += max(0.0, call_s - max(s.step_s for s in ranks))
        steps += ranks[0].steps
        requests += submitted
    return {"actor_call_overhead_us_per_step": round(1e6 * extra_s / max(steps, 1), 1),
            "actor_call_overhead_ms_per_request": round(1e3 * extra_s / max(requests, 1), 2)}


def _quantile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def format_table(rows: list[Row]) -> str:
    head = (f"{'request':<14}{'tier':<9}{'prefix':>7}{'L2 hit':>7}{'L2 load':>8}{'L3 hit':>7}"
            f"{'extend':>7}  {'cached L1/L2/L3':<16}{'TTFT s':>8}{'cold s':>8}{'ratio':>7}"
            f"  same")
    lines = [head, "-" * len(head)]
    for r in rows:
        n, c = r.out.lengths, r.out.cached
        tier = r.tier if r.tier == r.expected else f"{r.tier}!"
        lines.append(f"{r.instance + ': q' + str(r.question):<14}{tier:<9}{n.prefix_len:>7}"
                     f"{n.host_hit_length:>7}{n.host_loaded_length:>8}{n.storage_hit_length:>7}"
                     f"{n.extend_len:>7}  {f'{c.device}/{c.host}/{c.storage}':<16}"
                     f"{r.out.ttft_s:>8.3f}{r.cold.ttft_s:>8.3f}{r.ratio:>7.3f}  "
                     f"{'yes' if r.identical else 'NO'}")
    return "\n".join(lines)
