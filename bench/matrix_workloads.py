"""The experiment matrix's workloads (A..E) and configurations (0..5), as plain data.

A workload is two rounds of turns (which instance gets which prompt) and the L1 size it runs
with; a configuration is one `HiCacheConfig`. Nothing here runs a model: `kvtier.bench.matrix`
does, and tests build these from a fake tokenizer.
"""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

from kvtier.config import HiCacheConfig
from kvtier.engine.request import pages_for

Encode = Callable[[str], Sequence[int]]


class MatrixSizes(NamedTuple):
    """How big the run is. Documents are whole multiples of `chunk_tokens` (a hit is reused
    only down to the prefill chunk grid)."""

    page_size: int
    chunk_tokens: int
    system_tokens: int  # A's shared system prompt
    document_tokens: int  # B's and D's document, each of C's two, each of E's prompts
    new_tokens: int  # greedy tokens per request
    requests: int  # A's requests per round; B, C and E use fewer (see build_workloads)
    instances: int  # D's engines sharing one L3 directory
    timeouts_s: tuple[float, ...]  # configuration 5's prefetch timeouts


QUICK = MatrixSizes(page_size=64, chunk_tokens=256, system_tokens=256, document_tokens=768,
                    new_tokens=4, requests=3, instances=3, timeouts_s=(0.05, 0.5))
FULL = MatrixSizes(page_size=64, chunk_tokens=512, system_tokens=1024, document_tokens=2048,
                   new_tokens=16, requests=8, instances=4, timeouts_s=(0.05, 0.5, 2.0))


class Turn(NamedTuple):
    instance: int  # which engine of the workload answers (0 unless D)
    tokens: tuple[int, ...]


class Workload(NamedTuple):
    name: str  # "A".."E"
    title: str
    rounds: tuple[tuple[Turn, ...], tuple[Turn, ...]]  # round 1 builds the cache, round 2 reuses
    device_pages: int  # L1 pages of each instance
    instances: int = 1


class MatrixConfig(NamedTuple):
    """One column of the matrix; configuration 5 appears once per timeout."""

    config: int  # 0..5
    label: str
    timeout_s: float | None = None

    @property
    def has_l3(self) -> bool:
        return self.config >= 3

    @property
    def key(self) -> str:
        return str(self.config) if self.timeout_s is None else f"5@{self.timeout_s:g}s"


CONFIG_LABELS = {0: "L1 only", 1: "L2 write_back", 2: "L2 selective",
                 3: "L3 best_effort", 4: "L3 wait_complete", 5: "L3 timeout"}


def filler_tokens(encode: Encode, num_tokens: int, topic: int) -> list[int]:
    """Exactly `num_tokens` tokens of a synthetic station log; another `topic` differs from
    its first page on (so two topics share no cached prefix)."""
    lines: list[str] = []
    ids: list[int] = []
    while len(ids) < num_tokens:
        start = len(lines)
        lines += [f"Entry {i} of log {topic}: station {(i * 7 + topic) % 23} measured "
                  f"{(i * 37 + topic * 11) % 101} units at {8 + i % 10}:{(i * 7) % 60:02d}."
                  for i in range(start, start + 32)]
        ids = list(encode(f"Log number {topic} ({topic * 7919 % 1000}).\n" + "\n".join(lines)))
    return ids[:num_tokens]


def question(encode: Encode, k: int) -> list[int]:
    return list(encode(f"\n\nQuestion {k}: what did station {k % 23} measure in entry "
                       f"{3 * k + 1}? Answer:"))


def _roomy_pages(turns: Sequence[Turn], new_tokens: int, page_size: int) -> int:
    """L1 that holds every prompt of a round with its output: reuse never needs L2 there."""
    return sum(pages_for(len(t.tokens) + new_tokens, page_size) for t in turns) + 2


def build_workloads(encode: Encode, sizes: MatrixSizes) -> list[Workload]:
    """The five workloads of the seed's matrix, sized by `sizes`. Round 2 asks follow-ups
    (new questions on the same prefix), except E, whose round 2 is new distinct prompts:

    - A: `requests` prompts = the system prompt + a short question, per round;
    - B: `requests // 2` (at least 2) questions on one document, per round;
    - C: documents 0, 1, 0, 1, ... with a new question each (at least 4 per round); L1 holds
      one document and one request, never both documents;
    - D: instance i asks question i on the one document (instance 0 first, so with L3 the
      others can hit what it stored);
    - E: `requests // 2` (at least 2) distinct documents per round, no shared page.
    """
    chunk, n, new = sizes.chunk_tokens, sizes.requests, sizes.new_tokens
    if sizes.system_tokens % chunk or sizes.document_tokens % chunk:
        raise ValueError("system_tokens and document_tokens must be multiples of chunk_tokens")
    system = filler_tokens(encode, sizes.system_tokens, topic=900)
    doc = filler_tokens(encode, sizes.document_tokens, topic=901)
    docs = (filler_tokens(encode, sizes.document_tokens, topic=902),
            filler_tokens(encode, sizes.document_tokens, topic=903))

    def ask(prefix: list[int], k: int, instance: int = 0) -> Turn:
        return Turn(instance, tuple(prefix + question(encode, k)))

    a = tuple(tuple(ask(system, r * n + i) for i in range(n)) for r in range(2))
    nb = max(2, n // 2)
    b = tuple(tuple(ask(doc, r * nb + i) for i in range(nb)) for r in range(2))
    nc = max(4, n // 2 * 2)  # alternating: doc 0, doc 1, doc 0, ...
    c = tuple(tuple(ask(docs[i % 2], r * nc + i) for i in range(nc)) for r in range(2))
    m = sizes.instances
    d = tuple(tuple(ask(doc, r * m + i, instance=i) for i in range(m)) for r in range(2))
    ne = max(2, n // 2)
    e = tuple(tuple(Turn(0, tuple(filler_tokens(encode, sizes.document_tokens, topic=r * ne + i)))
                    for i in range(ne)) for r in range(2))
    page = sizes.page_size
    longest_c = max(len(t.tokens) for t in c[0] + c[1])
    c_pages = pages_for(longest_c + new, page) + 1  # one document and one request, not two
    assert c_pages < 2 * pages_for(sizes.document_tokens, page), "C's L1 would hold both"
    return [
        Workload("A", "shared system prompt", a, _roomy_pages(a[0], new, page)),
        Workload("B", "one long document, many questions", b, _roomy_pages(b[0], new, page)),
        Workload("C", "two documents alternating, L1 holds one", c, c_pages),
        Workload("D", f"{m} instances, one document, one L3 directory", d,
                 _roomy_pages(d[0], new, page), instances=m),
        Workload("E", "no reuse (distinct prompts)", e, _roomy_pages(e[0], new, page)),
    ]


def matrix_configs(timeouts_s: Sequence[float]) -> list[MatrixConfig]:
    """Configurations 0..4, then 5 once per timeout."""
    out = [MatrixConfig(i, CONFIG_LABELS[i]) for i in range(5)]
    return out + [MatrixConfig(5, CONFIG_LABELS[5], float(t)) for t in timeouts_s]


def hicache_config(mc: MatrixConfig, page_size: int, l3_dir: str | None) -> HiCacheConfig:
    """The HiCacheConfig of one column; L3 columns use the `file` backend under `l3_dir`.
    Configuration 5's timeout is exactly `timeout_s` (no per-token part)."""
    if mc.config == 0:
        return HiCacheConfig(page_size=page_size, enable_hierarchical_cache=False)
    if mc.config == 1:
        return HiCacheConfig(page_size=page_size, write_policy="write_back")
    if mc.config == 2:
        return HiCacheConfig(page_size=page_size, write_policy="write_through_selective")
    if l3_dir is None:
        raise ValueError(f"configuration {mc.config} needs an L3 directory")
    l3 = {"page_size": page_size, "storage_backend": "file",
          "storage_options": {"root_dir": l3_dir}, "write_policy": "write_through"}
    if mc.config == 3:
        return HiCacheConfig(prefetch_policy="best_effort", **l3)
    if mc.config == 4:
        return HiCacheConfig(prefetch_policy="wait_complete", **l3)
    t = float(mc.timeout_s if mc.timeout_s is not None else 2.0)
    return HiCacheConfig(prefetch_policy="timeout", prefetch_timeout_base_s=t,
                         prefetch_timeout_per_ki_token_s=0.0,
                         prefetch_timeout_max_s=max(t, 30.0), **l3)
