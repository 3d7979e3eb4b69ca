"""`kvtier bench instances`: the demo's workload (two SmolLM2 instances sharing a document
through L1, L2 and the L3 namespace actor) at TP=3, reported as figures: TTFT per tier
against cold, the agreement collective's time per scheduling step (p50/p99, and how many
collectives a step runs), and the actor-call overhead per step and per request.

    kvtier bench instances --json
    kvtier bench instances --hosts 3 --l3 mooncake --json   # root: across three hosts
    kvtier bench instances --model /models/my-llama --tp 2 --hicache-mem-layout page_first_direct
    kvtier bench instances --writer-tp 1 --reader-tp 3 --json   # L3 across TP sizes
    kvtier bench instances --l3 none --peer --json   # B reads A's L2 (peer-to-peer L2)

`--model` and SGLang's `--hicache-*` flags / `--hicache-config` are the demo's
(kvtier.cli.demo_flags): another model, and every rank's cache config.

With `--hosts 3` the same workload runs on three hosts of this machine (kvtier demo --hosts)
and the report adds `ttft_l3_cross_host_ratio` (B's L3 hit on host 3 of what A computed on
host 2, over B's cold TTFT on host 3), `l3_read_gbps` (kvtier's L3 reads, all ranks' bytes
over the longest rank's read time, B's fastest of L3_READ_TRIES answers, its L1 and L2
dropped before each: cli/demo.py), `raw_mooncake_read_gbps` (Mooncake's own batch_get_into
of as many objects of the same size between the same hosts, as many readers as ranks, the
fastest of its rounds),
`raw_tcp_gbps` (one TCP stream host 2 -> host 3: the ceiling), `bytes_across_hosts`, and
per-object figures of kvtier's and the raw read (`l3_read`, `raw_mooncake_read`).

With `--writer-tp W --reader-tp R` it measures L3 across TP sizes instead (bench/cross_tp):
an instance at TP=W stores the document, one at TP=R reads it from L3; the report has
`identical`, `storage_hit_tokens` and `cross_tp_l3_ratio` (the reader's TTFT over its cold
TTFT).

With `--l3 none --peer` it measures peer-to-peer L2 instead (bench/peer): L3 off, B reads the
document from A's L2 over NIXL (`--peer-transport mooncake`: Mooncake's transfer engine);
the report has `identical`, `peer_hit_tokens`, `ttft_peer_ratio` (B's TTFT over its cold
TTFT), `peer_read_gbps` and `raw_transport_gbps` (the transport alone on the same bytes).
"""
from __future__ import annotations

import argparse
import json

from kvtier.cli import demo, demo_flags, demo_report
from kvtier.cli.shared_flags import add_dtype_flag, add_tp_flag
from kvtier.bench import emit
from kvtier.frontend.settings import L3_NONE
from kvtier.policies import Transport


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object (no table)")
    add_tp_flag(p, 3, "every step runs the agreement")
    p.add_argument("--tokens", type=int, default=2000, help="document tokens (default 2000)")
    p.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per answer")
    add_dtype_flag(p, note=", as kvtier demo; with --writer-tp/--reader-tp auto is fp32: bf16 "
                        "rounds differently per TP size")
    p.add_argument("--hosts", type=int, default=0,
                   help="3: across three hosts made on this machine (root)")
    p.add_argument("--writer-tp", type=int, default=0,
                   help="with --reader-tp: an instance of this TP size writes the document to "
                        "L3, and one of the reader's TP size reads it (L3 across TP sizes)")
    p.add_argument("--reader-tp", type=int, default=0, help="see --writer-tp")
    p.add_argument("--peer", action="store_true",
                   help="with --l3 none: B reads the document from A's L2 (peer-to-peer L2)")
    p.add_argument("--peer-transport", default=Transport.NIXL.value,
                   choices=[t.value for t in Transport.across_processes()],
                   help="with --peer: how B reads A's L2 (default nixl)")
    demo_flags.add_arguments(p, allow_none=True)  # --l3, --model and SGLang's --hicache-*
    # flags, as kvtier demo; --l3 none only with --peer


def params_from(ns: argparse.Namespace) -> demo.DemoParams:
    cache = demo_flags.cache_from_args(ns)  # l3, l3_root, page_size, hicache
    return demo.DemoParams(tokens=ns.tokens, new_tokens=ns.new_tokens, progress=not ns.json,
                           tp_size=ns.tp, dtype=ns.dtype, hosts=ns.hosts, model=ns.model,
                           **cache._asdict())


def main(ns: argparse.Namespace) -> int:
    params = params_from(ns)
    if ns.peer or params.l3 == L3_NONE:
        return _peer(ns, params)
    if ns.writer_tp or ns.reader_tp:
        return _cross_tp(ns, params)
    if ns.hosts:
        from kvtier.cli.demo_hosts import run_on_hosts

        result, text = run_on_hosts(params, ceilings=True)
        if not ns.json:
            print(text)
    else:
        result, rows = demo.run(params)
        if not ns.json:
            print(demo_report.format_table(rows))
    result = {"benchmark": "instances", **result}
    print(json.dumps(result))
    return 0 if result["identical"] else 1


def _cross_tp(ns: argparse.Namespace, params: demo.DemoParams) -> int:
    from kvtier.bench import cross_tp
    from kvtier.dtypes import DType
    from kvtier.errors import ConfigError

    if ns.writer_tp < 1 or ns.reader_tp < 1:
        raise ConfigError("give both --writer-tp and --reader-tp (TP sizes of the model's "
                          f"KV heads), got {ns.writer_tp} and {ns.reader_tp}")
    if params.dtype == DType.AUTO.value:  # see cross_tp's docstring: bf16 near-ties may flip
        params = params._replace(dtype=DType.FP32.value)
    result = {"benchmark": "instances", "mode": "cross_tp",
              **cross_tp.run(params, ns.writer_tp, ns.reader_tp)}
    emit(result, ns.json)
    return 0 if result["identical"] else 1


def _peer(ns: argparse.Namespace, params: demo.DemoParams) -> int:
    from kvtier.bench import peer
    from kvtier.errors import ConfigError

    if not (ns.peer and params.l3 == L3_NONE):
        raise ConfigError("peer-to-peer L2 is measured with L3 off: give --l3 none and --peer "
                          "together")
    if ns.writer_tp or ns.reader_tp or ns.hosts:
        raise ConfigError("--peer runs two instances of one TP size on local Ray: drop "
                          "--writer-tp/--reader-tp and --hosts")
    result = {"benchmark": "instances",
              **peer.run(params, Transport(ns.peer_transport))}
    emit(result, ns.json)
    return 0 if result["identical"] else 1
