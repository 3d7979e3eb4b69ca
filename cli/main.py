"""The `kvtier` command line: demo and benchmarks."""
from __future__ import annotations

import argparse
import logging
import sys

from kvtier.bench.trace import TraceShape
from kvtier.errors import KvtierError


def _gen_trace(ns: argparse.Namespace) -> int:
    from kvtier.bench.trace import write_trace

    shape = TraceShape(**{k: getattr(ns, k) for k in TraceShape.__dataclass_fields__})
    n = write_trace(ns.out, shape)
    print(f"wrote {n} requests to {ns.out}")
    return 0


def _add_gen_trace(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    for name, f in TraceShape.__dataclass_fields__.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=f.default)


def _command(sub, name: str, module, help_text: str) -> None:
    """A subcommand whose module has `add_arguments(parser)` and `main(ns) -> int`."""
    p = sub.add_parser(name, help=help_text)
    module.add_arguments(p)
    p.set_defaults(func=module.main)


def build_parser() -> argparse.ArgumentParser:
    from kvtier.cli import demo
    from kvtier.cli import serve_command
    from kvtier.bench import (chaos, instances, matrix, pd, prefix, serve_bench, soak, storage,
                              transfer, tree, vllm_bench)

    parser = argparse.ArgumentParser(prog="kvtier", description="kvtier: a hierarchical KV cache")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    _command(sub, "serve", serve_command, "the OpenAI-compatible serve graph (ingress, "
             "router, instances) on Ray")
    _command(sub, "demo", demo, "two SmolLM2 instances (or --model's) on local Ray share a "
             "document through L1, L2 and L3")
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    _command(bench, "tree", tree, "replay a trace through the HiRadixTree")
    _command(bench, "transfer", transfer, "L1<->L2 copy bandwidth per host layout")
    _command(bench, "storage", storage, "L3 backend write/read GB/s next to the raw library")
    _command(bench, "prefix", prefix, "SmolLM2 TTFT: cold vs L1, L2 and L3 hits")
    _command(bench, "vllm", vllm_bench, "SmolLM2 through vLLM with and without KvtierConnector: "
             "TTFT cold and from L2, answers, overhead, copy GB/s")
    _command(bench, "instances", instances, "the demo's two instances at TP=3: TTFT per tier, "
             "agreement time per step, actor-call overhead")
    _command(bench, "pd", pd, "prefill/decode disaggregation: TTFT and KV transfer GB/s "
             "next to a mixed instance and the bare transport")
    _command(bench, "matrix", matrix, "experiment matrix: workloads A-E x configurations 0-5")
    _command(bench, "serve", serve_bench, "multi-turn chat load on the serve graph, cache on/off")
    _command(bench, "soak", soak, "mixed traffic with aborts and L3 faults: answers checked, "
             "leaks counted")
    _command(bench, "chaos", chaos, "the serve graph under real and adversarial clients while "
             "ranks, the namespace actor and the Mooncake master fail: answers checked, leaks "
             "counted")
    g = bench.add_parser("gen-trace", help="write a synthetic multi-turn trace")
    _add_gen_trace(g)
    g.set_defaults(func=_gen_trace)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except KvtierError as error:  # a clear message, not a traceback, for what users can fix
        print(f"kvtier: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
