"""kvtier in one process: fill L1, evict to L2, load back, reuse from L3; the five lengths.

Run with `make demo` (or `.venv/bin/python examples/single_process.py`). The KV written for a
page is a deterministic function of its prefix (kvtier.tiers.reference_kv), so every hit is
checked byte for byte against what a recomputation writes. The engine (part 3) replaces this
stand-in with a real model.
"""
from __future__ import annotations

import argparse
import random
import tempfile

import torch

from kvtier.config import HiCacheConfig
from kvtier.kv_spec import KVSpec
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.reference_kv import serve_reference


def serve(cache: HierarchicalCache, tokens: list[int]) -> tuple:
    """One request: L3 prefetch, lookup (+ load-back), compute the rest, store it."""
    done = serve_reference(cache, tokens)
    if done is None:
        raise SystemExit("L1 is too small for this request; raise --device-pages")
    return done.lengths(), done.kv_ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-pages", type=int, default=48, help="L1 capacity in pages")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--write-policy", default="write_through")
    ap.add_argument("--mem-layout", default="page_first")
    ap.add_argument("--l3-dir", default=None, help="file L3 root (default: a temporary dir)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-l3-") as tmp:
        return run(args, args.l3_dir or tmp)


def run(args: argparse.Namespace, l3_dir: str) -> int:
    config = HiCacheConfig.from_dict({
        "page_size": args.page_size, "hicache_ratio": 4.0, "load_back_threshold_tokens": 16,
        "write_policy": args.write_policy, "mem_layout": args.mem_layout,
        "storage_backend": "file", "storage_options": {"root_dir": l3_dir},
        "prefetch_policy": "wait_complete", "prefetch_threshold_tokens": 64,
    }).normalize()
    spec = KVSpec(num_layers=4, num_kv_heads=2, head_dim=32, page_size=args.page_size,
                  dtype=torch.float32)
    rng = random.Random(0)
    doc_a = [rng.randrange(32000) for _ in range(400)]
    doc_b = [rng.randrange(32000) for _ in range(600)]
    question = lambda: [rng.randrange(32000) for _ in range(24)]  # noqa: E731
    steps = [
        ("doc A + question 1 (cold)", doc_a + question()),
        ("doc A + question 2 (L1 hit)", doc_a + question()),
        ("doc B (pushes doc A out of L1)", doc_b + question()),
        ("doc A + question 3 (L2 hit, loaded back)", doc_a + question()),
        ("doc A + question 4 (L1 hit again)", doc_a + question()),
    ]
    print(f"config: {config.describe()}")
    print(f"L1 {args.device_pages} pages x {args.page_size} tokens; KV {spec.page_bytes} B/page; "
          f"L3: file backend in {l3_dir}\n")
    header = f"{'request':<42} {'prefix':>6} {'host_hit':>8} {'loaded':>6} {'storage':>7} {'extend':>6}  bytes"
    print(header)
    print("-" * len(header))
    all_ok = True

    def row(name: str, cache: HierarchicalCache, tokens: list[int]) -> None:
        nonlocal all_ok
        lengths, ok = serve(cache, tokens)
        all_ok &= ok
        print(f"{name:<42} {lengths.prefix_len:>6} {lengths.host_hit_length:>8} "
              f"{lengths.host_loaded_length:>6} {lengths.storage_hit_length:>7} "
              f"{lengths.extend_len:>6}  {'match' if ok else 'MISMATCH'}")

    with HierarchicalCache(config, spec, args.device_pages, model="demo") as cache:
        for name, tokens in steps:
            row(name, cache, tokens)
        cache.flush()
        cache.storage.drain()  # instance A's L2 -> L3 backups land
        stats = cache.tree_stats()
        print(f"\ninstance A tree: {stats.num_nodes} nodes; L1 evictable "
              f"{stats.device_evictable_pages} pages, L2-only {stats.host_evictable_pages} pages")
        print("instance A cache:", cache.counters.snapshot())
        print("instance A L3:", cache.storage.counters.snapshot())
        print("instance A copies:", cache.controller.stats(), "\n")
    with HierarchicalCache(config, spec, args.device_pages, model="demo") as other:
        row("instance B: doc A + question 5 (L3 hit)", other, doc_a + question())
        print("\ninstance B L3:", other.storage.counters.snapshot())
    print("\nevery cached prefix matched a recomputation byte for byte" if all_ok
          else "\nMISMATCH: a cached prefix differs from its recomputation")
    return 0 if all_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
