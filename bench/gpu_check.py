"""A one-shot GPU check, one JSON object: what a GPU machine does with kvtier's own code.

Two parts, each on CUDA when present (pinned L2, copy streams) and on the CPU otherwise
(`"cuda": false`: the same code, nothing pinned):

- transfer: `bench transfer`'s L1<->L2 copies (the cache controller, every host layout) and,
  in the same run, a plain torch copy of the same bytes from pinned host memory: the copies'
  GB/s (`load_gbps`, `write_gbps`: the default layout's) and the load's ratio to the plain
  copy (`load_ratio`; `plain_copy_gbps`).
- l2_hit: the tiny random model in-process with L1 on the device: a prompt computed cold,
  then L1 emptied (its pages written back to L2 first) and the same prompt again, its prefix
  loaded back from L2. Deterministic mode: the answer must equal the cold one, tokens and
  logits (`l2_hit_equal_cold`).

`scripts/gpu_check.sh` runs it on a machine where kvtier is not installed (Python with torch
and numpy is enough); `python -m kvtier.bench.gpu_check` where it is.
"""
from __future__ import annotations

import json
import platform
import sys
import time
from typing import NamedTuple

import torch

from kvtier.bench.transfer import TransferBenchParams, run as run_transfer
from kvtier.config import HiCacheConfig
from kvtier.dtypes import DType, name as dtype_name, resolve
from kvtier.engine.engine import Engine
from kvtier.engine.loader import load_tiny_model
from kvtier.engine.sampling import SamplingParams
from kvtier.policies import IoBackend
from kvtier.tiers.device_pool import default_device
from kvtier.tiers.hierarchical_cache import HierarchicalCache


class GpuCheckParams(NamedTuple):
    transfer_pages: int  # SmolLM2-135M pages per timed copy
    transfer_repeats: int
    page_size: int = 16  # the tiny model's pages
    prompt_pages: int = 4  # whole pages of prompt before its tail
    new_tokens: int = 8


ON_GPU = GpuCheckParams(transfer_pages=256, transfer_repeats=5)  # 377 MB per bf16 copy
ON_CPU = GpuCheckParams(transfer_pages=16, transfer_repeats=2)  # a smoke run: seconds


def default_params() -> GpuCheckParams:
    return ON_GPU if torch.cuda.is_available() else ON_CPU


def environment() -> dict:
    """What ran the check: versions, and the device's name."""
    cuda = torch.cuda.is_available()
    return {"cuda": cuda, "torch": torch.__version__, "cuda_version": torch.version.cuda,
            "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor()
            or platform.machine(),
            "device_count": torch.cuda.device_count() if cuda else 0,
            "python": platform.python_version()}


def transfer(params: GpuCheckParams) -> dict:
    """L1<->L2 GB/s per layout (the kernel backend's, and the direct one's best) next to the
    plain pinned copy measured in the same run."""
    result = run_transfer(TransferBenchParams(pages=params.transfer_pages,
                                              repeats=params.transfer_repeats))
    layouts = {layout: {k: e[k] for k in ("write_gbps", "load_gbps", "load_ratio")}
               for layout, e in result["layouts"].items()}
    default = layouts[HiCacheConfig().mem_layout.value]  # what a cache uses unless told
    direct = result["backends"].get(IoBackend.DIRECT.value, {}).get("layouts", {})
    best = max(layouts.values(), key=lambda e: e["load_gbps"])
    return {"device": result["device"], "pinned": torch.cuda.is_available(),  # as HostPool
            "bytes": result["bytes"], "dtype": result["dtype"],
            "plain_copy_gbps": result["plain_copy_gbps"],  # host to device, pinned on CUDA
            "load_gbps": default["load_gbps"], "write_gbps": default["write_gbps"],
            "load_ratio": default["load_ratio"], "best_load_ratio": best["load_ratio"],
            "layouts": layouts,
            "fragmented_load_gbps": {layout: e["load_gbps"]
                                     for layout, e in result["layouts_fragmented"].items()},
            "direct_load_gbps": {layout: e["load_gbps"] for layout, e in direct.items()},
            "elapsed_s": result["elapsed_s"]}


def l2_hit(params: GpuCheckParams) -> dict:
    """The tiny model on the device: cold, then the same prompt from L2 (load-back)."""
    device = default_device()
    dtype = resolve(DType.AUTO, device)
    model = load_tiny_model(dtype, device)
    page = params.page_size
    config = HiCacheConfig.from_dict({"page_size": page, "hicache_ratio": 4.0,
                                      "load_back_threshold_tokens": page})
    cache = HierarchicalCache(config, model.kv_spec(page), 64, device=device, model="tiny")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (params.prompt_pages * page + 5,),
                           generator=generator).tolist()
    sampling = SamplingParams(max_new_tokens=params.new_tokens)
    started = time.perf_counter()
    with Engine(model, cache, owns_cache=True, deterministic=True) as engine:
        cold = engine.generate([prompt], sampling)[0]
        cache.flush()  # the write-through copies land in L2
        cache.evict_device(cache.device_pages)  # L1 empty: only L2 holds the prefix
        hit = engine.generate([prompt], sampling)[0]
        snap = cache.snapshot()
        copies, pinned = snap.transfers, snap.host_pinned
    same_logits = torch.equal(hit.prefill_logits, cold.prefill_logits)
    diff = (hit.prefill_logits.float() - cold.prefill_logits.float()).abs().max().item()
    return {"device": str(model.device), "dtype": dtype_name(dtype), "l2_pinned": pinned,
            "prompt_tokens": len(prompt), "new_tokens": len(cold.tokens),
            "cold_cached_tokens": cold.cached.total,
            "hit_l1_tokens": hit.cached.device, "hit_l2_tokens": hit.cached.host,
            "l2_load_bytes": copies.load_bytes, "l2_write_bytes": copies.write_bytes,
            "tokens_equal": hit.tokens == cold.tokens, "logits_equal": same_logits,
            "max_logit_diff": diff,
            "l2_hit_equal_cold": bool(hit.tokens == cold.tokens and same_logits
                                      and hit.cached.host > 0 and cold.cached.total == 0),
            "elapsed_s": round(time.perf_counter() - started, 2)}


def run(params: GpuCheckParams | None = None) -> dict:
    """The whole check; `ok` when both parts ran and the L2 hit equals the cold run."""
    params = params or default_params()
    started = time.perf_counter()
    result = {"check": "kvtier-gpu", **environment()}
    result["transfer"] = transfer(params)
    result["l2_hit"] = l2_hit(params)
    result["l2_hit_equal_cold"] = result["l2_hit"]["l2_hit_equal_cold"]
    result["ok"] = result["l2_hit_equal_cold"]
    result["elapsed_s"] = round(time.perf_counter() - started, 2)
    return result


def main() -> int:
    """One JSON line on stdout (whatever else prints goes to stderr); 0 when `ok`."""
    out, sys.stdout = sys.stdout, sys.stderr
    try:
        result = run()
    except Exception as exc:  # noqa: BLE001 - the check reports any failure as its answer
        result = {"check": "kvtier-gpu", "ok": False, **environment(),
                  "error": f"{type(exc).__name__}: {exc}"}
    finally:
        sys.stdout = out
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
