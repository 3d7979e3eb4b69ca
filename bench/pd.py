"""`kvtier bench pd`: prefill/decode disaggregation next to one mixed instance.

    kvtier bench pd --pd-transport nixl --json
    kvtier bench pd --pd-transport mooncake --tokens 2048 --json

On local Ray, three instances of the demo's model (TP=--tp each): a mixed one, a prefill one
and a decode one. Each of `--requests` documents (the demo's document, a different opening
sentence each, so every prefill is cold) is answered by the mixed instance, then through
prefill -> transfer -> decode. Then, between the same two rank processes, the transport
alone moves the same bytes with the same descriptor list (the request's pages' regions)
`--raw-repeats` times. With `--decode-tp` the decode instance has another TP size: the
hand-offs are staged through L2 head objects, and so are the bare transport's writes.

Fields:
- `identical`: every PD answer equals the mixed answer (greedy);
- `ttft_pd_s`, `ttft_mixed_s`: arrival to the first token (the prefill instance samples it),
  the mean over requests, and `ttft_ratio` (target <= 1.3 with prompts of 2,000+ tokens);
- `transfer_gbps`: a hand-off's bytes per rank over its slowest rank's write time, and
  `raw_transport_gbps`: the transport alone, every rank pair at once, the same way (target:
  transfer >= 0.8 x raw); both the median over their runs;
- `stage_s`: the mean seconds of each stage (bootstrap, prefill, transfer, kv_ready,
  decode_queue); `transferred_bytes`, `transferred_pages` per request; `modes`.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from kvtier.cli import demo, demo_flags
from kvtier.cli.shared_flags import add_dtype_flag, add_pd_transport_flag, add_tp_flag
from kvtier.policies import Transport
from kvtier.errors import ConfigError

if TYPE_CHECKING:  # a name only: the actors are imported when a run starts
    from kvtier.actors.pd.rank_port import RankTransportCounters

TARGET_TTFT_RATIO = 1.3
TARGET_TRANSFER_RATIO = 0.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object (no table)")
    add_pd_transport_flag(p, Transport.NIXL.value)
    add_tp_flag(p, 1)
    p.add_argument("--decode-tp", type=int, default=0,
                   help="the decode instance's TP size when it differs from --tp (the "
                        "hand-off is then staged through L2 head objects; --dtype auto is "
                        "fp32 then: TP sizes round bf16 KV differently)")
    p.add_argument("--tokens", type=int, default=2048, help="document tokens (default 2048)")
    p.add_argument("--new-tokens", type=int, default=16, help="greedy tokens per answer")
    p.add_argument("--requests", type=int, default=5, help="documents answered (default 5)")
    p.add_argument("--raw-repeats", type=int, default=5,
                   help="runs of the bare transport over the same descriptors (default 5)")
    add_dtype_flag(p, note=", as kvtier demo")
    demo_flags.add_arguments(p)


def main(ns: argparse.Namespace) -> int:
    if ns.requests < 1 or ns.raw_repeats < 1:
        raise ConfigError("--requests and --raw-repeats must be >= 1")
    cache = demo_flags.cache_from_args(ns)
    params = demo.DemoParams(tokens=ns.tokens, new_tokens=ns.new_tokens, progress=not ns.json,
                             tp_size=ns.tp, dtype=ns.dtype, model=ns.model, **cache._asdict())
    decode_tp = ns.decode_tp or ns.tp
    if decode_tp != ns.tp and params.dtype == "auto":
        params = params._replace(dtype="fp32")
    result = run(params, ns.pd_transport, ns.requests, ns.raw_repeats, decode_tp)
    if not ns.json:
        for key in ("identical", "ttft_pd_s", "ttft_mixed_s", "ttft_ratio", "transfer_gbps",
                    "raw_transport_gbps", "transfer_ratio", "stage_s"):
            print(f"{key:>20}: {result[key]}")
    print(json.dumps(result))
    return 0 if result["identical"] else 1


class PDSession(NamedTuple):
    """What one bench/demo session measured."""

    model: Any  # demo.DemoModel
    prompts: list[list[int]]
    mixed: list[tuple[Any, float]]  # each prompt's mixed Output and its TTFT
    pd: list[Any]  # each prompt's PDOutput
    raw_gbps: list[float]  # the bare transport's runs
    counters: RankTransportCounters  # the prefill rank 0's


def session(params: demo.DemoParams, transport: str, prompts_of: Callable[[Any, Any], list],
            raw_repeats: int, decode_tp: int = 0) -> PDSession:
    """On local Ray: a mixed, a prefill and a decode instance; each prompt answered mixed,
    then through PD; then the bare transport's runs over the first prompt's pages."""
    from kvtier.actors.instance import Instance
    from kvtier.actors.pd.driver import PDDriver
    from kvtier.actors.rank_actor import RANK_NUM_CPUS
    from kvtier.actors.ray_env import start_local_ray

    model = demo.demo_model(params.model)
    decode_tp = decode_tp or params.tp_size
    for tp in (params.tp_size, decode_tp):
        demo._check_tp(params._replace(tp_size=tp), model)
    demo._import_everything()
    work = demo._workload(params, model)
    prompts = prompts_of(work, model)
    settings = work.settings._replace(config=demo_flags.cache_config(None, params.page_size,
                                                                     params.hicache))
    ranks = 2 * params.tp_size + decode_tp
    start_local_ray(num_cpus=max(2, math.ceil(ranks * RANK_NUM_CPUS)))
    with demo._Cluster() as cluster:
        for name in ("mixed", "prefill", "decode"):
            tp = decode_tp if name == "decode" else params.tp_size
            cluster.instances[name] = Instance(settings, tp_size=tp)
        mixed, prefill, decode = (cluster.instances[n] for n in ("mixed", "prefill", "decode"))
        for inst in (mixed, prefill, decode):
            inst.generate([work.warmup], work.greedy)  # first-call costs out of the timings
        pd = PDDriver([prefill], [decode], transport=transport)
        pd.generate([work.warmup], work.greedy)
        want = [_mixed_answer(mixed, p, work.greedy) for p in prompts]
        got = [pd.generate([p], work.greedy)[0] for p in prompts]
        raw = _raw_runs(prefill, decode, len(prompts[0]), raw_repeats, staged=pd.staged)
        counters = prefill.handoff_counters()[0]
    return PDSession(model, prompts, want, got, raw, counters)


def run(params: demo.DemoParams, transport: str, requests: int, raw_repeats: int,
        decode_tp: int = 0) -> dict:
    from kvtier.dtypes import name as dtype_name, resolve_here

    decode_tp = decode_tp or params.tp_size
    s = session(params, transport, lambda work, model: _documents(work, model, requests),
                raw_repeats, decode_tp)
    model, prompts, want, got, raw, counters = s
    # per rank pair (each prefill rank writes its share; the slowest rank's time), as the
    # bare transport's runs move one rank's share between one pair of rank processes
    sent_gbps = [o.transfer_bytes / params.tp_size / o.stages.transfer_s / 1e9 for o in got
                 if o.stages.transfer_s]
    raw_gbps = statistics.median(raw)
    transfer_gbps = statistics.median(sent_gbps) if sent_gbps else 0.0
    ttft_pd = statistics.fmean(o.ttft_s for o in got)
    ttft_mixed = statistics.fmean(t for _, t in want)
    stages = {k: round(statistics.fmean(getattr(o.stages, k) for o in got
                                        if getattr(o.stages, k) is not None), 4)
              for k in got[0].stages._fields
              if any(getattr(o.stages, k) is not None for o in got)}
    return {
        "benchmark": "pd", "transport": transport, "model": model.label, "tp": params.tp_size,
        "decode_tp": decode_tp, "staged": decode_tp != params.tp_size,
        "prompt_tokens": [len(p) for p in prompts], "requests": len(prompts),
        "identical": all(o.tokens == w.tokens for o, (w, _) in zip(got, want)),
        "modes": [o.mode.value for o in got],
        "ttft_pd_s": round(ttft_pd, 4), "ttft_mixed_s": round(ttft_mixed, 4),
        "ttft_ratio": round(ttft_pd / ttft_mixed, 4), "target_ttft_ratio": TARGET_TTFT_RATIO,
        "transfer_gbps": round(transfer_gbps, 3), "raw_transport_gbps": round(raw_gbps, 3),
        "transfer_ratio": round(transfer_gbps / raw_gbps, 3) if raw_gbps else None,
        "target_transfer_ratio": TARGET_TRANSFER_RATIO,
        "transfer_gbps_runs": [round(g, 3) for g in sent_gbps],
        "raw_transport_gbps_runs": [round(g, 3) for g in raw],
        "stage_s": stages,
        "transferred_bytes": got[0].transfer_bytes,
        "transport_bytes_total": counters.transfers.bytes if counters.transfers else None,
        "transport_descriptors_total": (counters.transfers.descriptors if counters.transfers
                                        else None),
        "dtype": params.dtype, "dtype_resolved": dtype_name(resolve_here(params.dtype)),
    }


def _documents(work: Any, model: Any, n: int) -> list[list[int]]:
    """The demo's first prompt, behind a different opening sentence per request (so no
    prefill hits another's pages)."""
    tok = model.tokenizer
    return [tok.encode(f"Document {i}: read it and answer.\n") + work.prompts[0]
            for i in range(n)]


def _mixed_answer(inst: Any, prompt: list[int], sampling: Any) -> tuple[Any, float]:
    """The mixed instance's answer and its TTFT, timed as the PD driver times its requests:
    from the add to the step that reports the first token."""
    start = time.perf_counter()
    req = inst.add_request(prompt, sampling)
    first = None
    while True:
        step = inst.step_report()
        now = time.perf_counter()
        if first is None and (req in step.progress or step.finished):
            first = now - start
        for out in step.finished:
            if out.request_id == req:
                return out, first


def _raw_runs(prefill: Any, decode: Any, num_tokens: int, repeats: int,
              gap_s: float = 0.0, through_kvtier: bool = False,
              staged: bool = False) -> list[float]:
    """GB/s per rank pair of the bare transport moving a prompt's pages between every
    prefill rank and its decode rank at once (as a hand-off does: a rank's share over the
    slowest rank's time), each run after `gap_s` without traffic between them."""
    out = []
    for i in range(repeats):
        time.sleep(gap_s)
        targets = decode.reserve_handoff(f"raw-{i}", num_tokens, staged=staged)
        if targets is None:
            raise ConfigError("the decode instance had no room for the raw transfer run")
        try:
            runs = prefill.raw_handoff_writes(targets, through_kvtier)
        finally:
            decode.cancel_handoff(f"raw-{i}")
        out.append(sum(b for b, _ in runs) / len(runs) / max(s for _, s in runs) / 1e9)
    return out
