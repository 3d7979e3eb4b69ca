"""`kvtier bench instances --writer-tp W --reader-tp R`: one L3 namespace across TP sizes.

L3 objects name KV heads, not TP ranks, so an instance of one TP size reads what one of
another TP size stored. The run (the demo's model and document, on local Ray):
1. a cold reference at the reader's TP size, without L3, answers the first question;
2. the writer (TP=W, L3 attached) answers it; its pages reach the L3 namespace;
3. the reader (TP=R, the same namespace, its L1/L2 empty) answers it from L3.

Fields: `identical` (the reader's answer equals the cold answer and the writer's;
`reader_tokens_equal_to_cold` counts the leading tokens that agree),
`storage_hit_tokens` (what the reader's prefix took from L3), `cross_tp_l3_ratio` (the
reader's TTFT over the cold TTFT; the target is <= 0.25), the three TTFTs and the L3
namespace's published pages.

Why answers can differ across TP sizes: a TP size sums its all-reduces in its own order, so
the KV one TP size stores differs from what another computes in the last bits (bf16: in the
last of 8 mantissa bits). Within one TP size a hit reads the very bytes a cold run computes.
So `--dtype auto` runs this mode in fp32, where the three answers agree; in bf16 a near-tie
between the two best tokens can flip between TP sizes, with or without L3 (measured: SmolLM2's
first answer token at TP 1 -> 3).
"""
from __future__ import annotations

import math
import tempfile
from typing import Any

from kvtier.cli import demo
from kvtier.dtypes import name as dtype_name, resolve_here
from kvtier.errors import ConfigError

TARGET_RATIO = 0.25


def run(params: demo.DemoParams, writer_tp: int, reader_tp: int) -> dict:
    """Measure one writer -> reader pass (see the module docstring); the JSON-able result."""
    if params.hosts or params.address:
        raise ConfigError("--writer-tp/--reader-tp run on local Ray only; drop --hosts")
    model = demo.demo_model(params.model)
    for tp in (writer_tp, reader_tp):
        demo._check_tp(params._replace(tp_size=tp), model)
    demo._import_everything()
    work = demo._workload(params, model)
    with tempfile.TemporaryDirectory(prefix="kvtier-cross-tp-") as tmp:
        outs, published = _run_on_local_ray(params, work, tmp, writer_tp, reader_tp)
    cold, written, read = outs
    return {
        "writer_tp": writer_tp, "reader_tp": reader_tp, "model": model.label,
        "prompt_tokens": len(work.prompts[0]),
        "identical": read.tokens == cold.tokens == written.tokens,
        "reader_equals_cold": read.tokens == cold.tokens,
        "writer_equals_cold": written.tokens == cold.tokens,
        "answer_tokens": len(cold.tokens),
        "reader_tokens_equal_to_cold": _common_prefix(read.tokens, cold.tokens),
        "storage_hit_tokens": read.cached.storage,
        "cross_tp_l3_ratio": round(read.ttft_s / cold.ttft_s, 4),
        "target_ratio": TARGET_RATIO,
        "ttft_cold_s": round(cold.ttft_s, 4), "ttft_writer_s": round(written.ttft_s, 4),
        "ttft_reader_l3_s": round(read.ttft_s, 4),
        "published_pages": published,
        "l3": params.l3, "dtype": params.dtype,
        "dtype_resolved": dtype_name(resolve_here(params.dtype)),
    }


def _run_on_local_ray(params: demo.DemoParams, work: Any, tmp: str, writer_tp: int,
                      reader_tp: int) -> tuple[tuple, int]:
    from kvtier.actors.instance import Instance
    from kvtier.actors.rank_actor import RANK_NUM_CPUS
    from kvtier.actors.ray_env import start_local_ray

    progress = demo._Progress(params)
    ranks = writer_tp + 2 * reader_tp
    start_local_ray(num_cpus=max(2, math.ceil(ranks * RANK_NUM_CPUS)))
    try:
        with demo._Cluster() as cluster:
            actor, info = demo._start_namespace(cluster, params, work, tmp, progress)
            for name, tp, l3 in (("cold", reader_tp, None), ("writer", writer_tp, info),
                                 ("reader", reader_tp, info)):
                progress.stage(f"instance {name} (TP={tp})")
                cluster.instances[name] = Instance(
                    work.settings._replace(l3=l3, l3_actor=actor), tp_size=tp)
            demo._warm_up(cluster.instances, work, progress)
            outs = tuple(_answer(cluster.instances[name], work, progress, name)
                         for name in ("cold", "writer", "reader"))
            published = cluster.client.stats(info.namespace).published_pages
    finally:
        progress.close()
    return outs, published


def _answer(inst: Any, work: Any, progress: Any, name: str) -> Any:
    """The first question, with the instance's L1/L2 dropped first, its backups landed after."""
    progress.stage(f"{name} answers")
    inst.drop_cache()
    inst.quiesce()
    out = inst.generate([work.prompts[0]], work.greedy)[0]
    inst.quiesce()  # the writer's L2 -> L3 backups have landed before the reader asks
    progress.done()
    return out


def _common_prefix(a: tuple, b: tuple) -> int:
    """How many leading tokens two answers share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
