"""`kvtier demo --pd`: the demo's document and questions through prefill/decode
disaggregation, each answer checked against a mixed instance's.

On local Ray: a mixed instance, a prefill instance and a decode instance (TP=--tp each). Each
question (the document plus the question) is answered by the mixed instance, then prefilled
on the prefill instance (the second and third questions reuse the document's pages it
cached), handed over (--pd-transport) and decoded on the decode instance. A table row per
request: its mode, what the prefill reused, the time of each stage, TTFT both ways, whether
the answers are equal; then one JSON line. Exit status 0 when every answer is equal.
"""
from __future__ import annotations

from typing import Any

from kvtier.cli import demo

STAGES = ("bootstrap_s", "prefill_s", "transfer_s", "kv_ready_s", "decode_queue_s")


def main(params: demo.DemoParams, transport: str, json_only: bool) -> int:
    import json

    from kvtier.bench import pd

    s = pd.session(params, transport, lambda work, model: list(work.prompts), raw_repeats=1)
    rows = [_row(i, o, w, t, s.model) for i, (o, (w, t)) in enumerate(zip(s.pd, s.mixed))]
    result = {"demo": "pd", "transport": transport, "model": s.model.label,
              "tp": params.tp_size, "identical": all(r["identical"] for r in rows),
              "requests": rows}
    if not json_only:
        print(format_table(rows))
        for r in rows:
            print(f"q{r['question']} answer: {r['answer']!r}")
    print(json.dumps(result))
    return 0 if result["identical"] else 1


def _row(i: int, out: Any, mixed: Any, ttft_mixed: float, model: Any) -> dict:
    stages = out.stages._asdict()
    return {"question": i + 1, "mode": out.mode.value, "prompt_tokens": len(out.prompt),
            "prefill_reused_tokens": out.cached.total,
            **{k: None if stages[k] is None else round(stages[k], 4) for k in STAGES},
            "ttft_pd_s": round(out.ttft_s, 4), "ttft_mixed_s": round(ttft_mixed, 4),
            "transfer_bytes": out.transfer_bytes,
            "identical": out.tokens == mixed.tokens,
            "answer": model.tokenizer.decode(list(out.tokens))}


def format_table(rows: list[dict]) -> str:
    head = ["q", "mode", "prompt", "reused", "bootstrap", "prefill", "transfer", "kv-ready",
            "dec.queue", "TTFT pd", "TTFT mixed", "MB moved", "equal"]
    lines = [head]
    for r in rows:
        ms = [("-" if r[k] is None else f"{r[k] * 1000:.1f}ms") for k in STAGES]
        lines.append([f"q{r['question']}", r["mode"], str(r["prompt_tokens"]),
                      str(r["prefill_reused_tokens"]), *ms, f"{r['ttft_pd_s']:.3f}s",
                      f"{r['ttft_mixed_s']:.3f}s", f"{r['transfer_bytes'] / 1e6:.1f}",
                      "yes" if r["identical"] else "NO"])
    widths = [max(len(row[i]) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in lines)
