"""`kvtier bench tree`: replay a trace through the HiRadixTree with slot accounting."""
from __future__ import annotations

import argparse
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvtier.bench import emit
from kvtier.bench.trace import Trace, read_trace
from kvtier.tiers.allocator import PageAllocator
from kvtier.tiers.radix_tree import HiRadixTree


@dataclass
class _Timings:
    samples: dict[str, list[int]] = field(default_factory=lambda: {
        k: [] for k in ("match", "insert", "evict", "lock", "unlock")})

    def summary(self, name: str) -> dict:
        ns = np.asarray(self.samples[name], dtype=np.float64)
        if ns.size == 0:
            return {"mean": 0.0, "p50": 0.0, "p99": 0.0, "count": 0}
        us = ns / 1000.0
        return {"mean": round(float(us.mean()), 3), "p50": round(float(np.percentile(us, 50)), 3),
                "p99": round(float(np.percentile(us, 99)), 3), "count": int(us.size)}


@dataclass
class _InFlight:
    conv: int
    tokens: tuple
    pages: list[int]
    node: object


def replay(trace: Trace, page_size: int, capacity_tokens: int, depth: int) -> dict:
    """Match, lock, evict, allocate per request; insert and unlock `depth` requests later."""
    allocator = PageAllocator(max(1, capacity_tokens // page_size))
    tree = HiRadixTree(page_size, allocator)
    work = [(r.conv, trace.prompt_tokens(r), trace.output_tokens(r)) for r in trace.requests]
    t = _Timings()
    clock = time.perf_counter_ns
    inflight: deque[_InFlight] = deque()
    busy: set[int] = set()
    prompt_tokens = hit_tokens = rejected = 0

    def finish() -> None:
        job = inflight.popleft()
        t0 = clock()
        res = tree.insert(job.tokens, job.pages)
        t1 = clock()
        allocator.free(res.unused_pages)
        t2 = clock()
        tree.unlock(job.node)
        t3 = clock()
        t.samples["insert"].append(t1 - t0)
        t.samples["unlock"].append(t3 - t2)
        busy.discard(job.conv)

    start = clock()
    for conv, prompt, output in work:
        while conv in busy:  # an earlier turn of this conversation is still in flight
            finish()
        t0 = clock()
        m = tree.match_prefix(prompt)
        t1 = clock()
        tree.lock(m.last_device_node)
        t2 = clock()
        t.samples["match"].append(t1 - t0)
        t.samples["lock"].append(t2 - t1)
        prompt_tokens += len(prompt)
        hit_tokens += len(m.device_indices) * page_size
        total = len(prompt) + len(output)
        need = -(-total // page_size) - len(m.device_indices)
        if need > allocator.num_free:
            t0 = clock()
            tree.evict_device(need - allocator.num_free)
            t.samples["evict"].append(clock() - t0)
        pages = allocator.alloc(need)
        if pages is None:  # capacity exhausted even after eviction: the request is refused
            rejected += 1
            tree.unlock(m.last_device_node)
            continue
        inflight.append(_InFlight(conv, prompt + output, m.device_indices + pages, m.last_device_node))
        busy.add(conv)
        if len(inflight) > depth:
            finish()
    while inflight:
        finish()
    elapsed = (clock() - start) / 1e9
    n = len(work)
    return {
        "requests": n,
        "rejected": rejected,
        "seconds": round(elapsed, 4),
        "requests_per_s": round(n / elapsed, 1) if elapsed else 0.0,
        "hit_rate": round(hit_tokens / prompt_tokens, 4) if prompt_tokens else 0.0,
        "page_size": page_size,
        "capacity_tokens": capacity_tokens,
        "depth": depth,
        "nodes": tree.stats().num_nodes,
        **{f"{k}_us": t.summary(k) for k in ("match", "insert", "evict", "lock", "unlock")},
    }


def match_scaling(page_size: int, sizes: tuple[int, ...] = (1_000, 10_000, 40_000),
                  prompt_pages: tuple[int, ...] = (4, 16, 64), probes: int = 300) -> list[dict]:
    """Mean match µs for prompts of several page counts against trees of several sizes.

    Each stored prefix shares a first page with many others (a wide node) and branches later,
    so a lookup walks real splits. Match cost should follow the prompt, not the tree.
    """
    import random

    rng = random.Random(0)
    out = []
    for size in sizes:
        tree = HiRadixTree(page_size, PageAllocator(size * 2 + 1))
        stored = []
        for i in range(size):
            head = [i % 64] * page_size  # 64 shared first pages
            body = [rng.randrange(1 << 20) for _ in range(page_size)]
            tokens = head + body
            tree.insert(tokens, tree.device_allocator.alloc(2))
            stored.append(tokens)
        for pages in prompt_pages:
            prompts = [rng.choice(stored) + [rng.randrange(1 << 20) for _ in range((pages - 2) * page_size)]
                       for _ in range(probes)]
            t0 = time.perf_counter_ns()
            for prompt in prompts:
                tree.match_prefix(prompt)
            mean_us = (time.perf_counter_ns() - t0) / probes / 1000
            out.append({"tree_nodes": tree.stats().num_nodes, "prompt_pages": pages,
                        "match_us": round(mean_us, 3)})
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="trace file (JSON Lines; see `bench gen-trace`)")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--capacity", type=int, default=131072, help="L1 capacity in token slots")
    p.add_argument("--depth", type=int, default=8, help="requests in flight before one completes")
    p.add_argument("--scaling", action="store_true",
                   help="also time matches against trees of 1k-40k prefixes (adds ~5 s)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(ns: argparse.Namespace) -> int:
    trace = read_trace(ns.trace)
    result = replay(trace, ns.page_size, ns.capacity, ns.depth)
    if ns.scaling:
        result["match_scaling"] = match_scaling(ns.page_size)
    emit(result, ns.json)
    return 0
