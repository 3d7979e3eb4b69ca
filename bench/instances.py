"""`kvtier bench instances`: the demo's workload (two SmolLM2 instances sharing a document
through L1, L2 and the L3 namespace actor) at TP=3, reported as figures: TTFT per tier
against cold, the agreement collective's time per scheduling step (p50/p99, and how many
collectives a step runs), and the actor-call overhead per step and per request.

    kvtier bench instances --json
"""
from __future__ import annotations

import argparse
import json

from kvtier import demo, demo_report


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object (no table)")
    p.add_argument("--l3", choices=demo.L3_BACKENDS, default="file")
    p.add_argument("--tp", type=int, choices=(1, 3), default=3,
                   help="TP ranks per instance (default 3: every step runs the agreement)")
    p.add_argument("--tokens", type=int, default=2000, help="document tokens (default 2000)")
    p.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per answer")


def main(ns: argparse.Namespace) -> int:
    params = demo.DemoParams(ns.l3, ns.tokens, ns.new_tokens, progress=not ns.json,
                             tp_size=ns.tp)
    result, rows = demo.run(params)
    result = {"benchmark": "instances", **result}
    if not ns.json:
        print(demo_report.format_table(rows))
    print(json.dumps(result))
    return 0 if result["identical"] else 1
