"""The tests' reference generation: `generate()`, prompts in, tokens out, on a plain L1 pool
(no hierarchy, no scheduler), and the same on every rank of a local TP group
(`generate_on_rank`, `tp_generate`, over tp_processes.run_tp).

The engine (kvtier.engine.Engine: the cache, admission and continuous batching) is what
serves; this is the smallest loop that exercises prefill, batched decode, sampling and stop
tokens, which the engine's answers are checked against.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvtier.engine.architectures import build_model
from kvtier.engine.model import PagedLlama
from kvtier.engine.parallel import TensorParallel
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.engine.tp_group import DEFAULT_TIMEOUT_S, rank_device
from kvtier.engine.weight_sources import WeightSource
from kvtier.errors import ConfigError
from kvtier.tiers.device_pool import DevicePool

from tp_processes import TPRunError, run_tp


@dataclass
class Generation:
    """One prompt's result. `tokens` ends with the stop token when finish_reason is "stop"."""

    prompt: list[int]
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = ""                 # "stop" or "length"
    prefill_logits: torch.Tensor | None = None  # last prompt token's logits, float32 on CPU
    pages: list[int] = field(default_factory=list)

    @property
    def length(self) -> int:
        """Tokens whose KV is in the pool: the prompt and every generated token but the last."""
        return len(self.prompt) + len(self.tokens) - 1


def _pages_needed(length: int, page_size: int) -> int:
    return -(-length // page_size)


def _grow(gen: Generation, length: int, pool: DevicePool) -> None:
    """Give `gen` enough pages for `length` tokens."""
    missing = _pages_needed(length, pool.spec.page_size) - len(gen.pages)
    if missing > 0:
        pages = pool.allocator.alloc(missing)
        if pages is None:
            raise ConfigError(f"the KV pool ({pool.num_pages} pages) is full; pass a larger "
                              f"num_pages to generate()")
        gen.pages.extend(pages)


def generate(model: PagedLlama, prompts: Sequence[Sequence[int]],
             params: SamplingParams | Sequence[SamplingParams] = SamplingParams(), *,
             page_size: int = 16, chunk_tokens: int | None = None,
             kv_dtype: torch.dtype | None = None, num_pages: int | None = None) -> list[Generation]:
    """Prefill each prompt (page-aligned chunks), then decode all of them as one batch."""
    per_prompt = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    if len(per_prompt) != len(prompts):
        raise ConfigError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
    if num_pages is None:
        num_pages = sum(_pages_needed(len(p) + s.max_new_tokens, page_size)
                        for p, s in zip(prompts, per_prompt))
    with DevicePool(model.kv_spec(page_size, kv_dtype), num_pages, device=model.device) as pool:
        runner = ModelRunner(model, pool, chunk_tokens)
        gens = [Generation(list(p)) for p in prompts]
        samplers = [Sampler(s, model.device, p) for s, p in zip(per_prompt, prompts)]
        for gen, sampler in zip(gens, samplers):
            _grow(gen, len(gen.prompt), pool)
            logits = runner.prefill(gen.prompt, 0, gen.pages)
            gen.prefill_logits = logits.cpu()
            _append(gen, sampler(logits), sampler.params)
        active = [i for i, g in enumerate(gens) if not g.finish_reason]
        while active:
            for i in active:
                _grow(gens[i], gens[i].length + 1, pool)
            logits = runner.decode([gens[i].tokens[-1] for i in active],
                                   [(gens[i].pages, gens[i].length) for i in active])
            for row, i in enumerate(active):
                _append(gens[i], samplers[i](logits[row]), samplers[i].params)
            active = [i for i in active if not gens[i].finish_reason]
        for gen in gens:
            pool.allocator.free(gen.pages)
        return gens


def _append(gen: Generation, token: int, params: SamplingParams) -> None:
    gen.tokens.append(token)
    if token in params.stops:
        gen.finish_reason = "stop"
    elif len(gen.tokens) >= params.max_new_tokens:
        gen.finish_reason = "length"


@dataclass(frozen=True)
class RankGeneration:
    """One rank's result: its share of the KV heads and the tokens it generated."""

    rank: int
    size: int
    num_kv_heads: int                   # KV heads in this rank's pool: total / size
    tokens: list[list[int]]             # per prompt
    finish_reasons: list[str]


def generate_on_rank(tp: TensorParallel, source: WeightSource, prompts: Sequence[Sequence[int]],
                     params: SamplingParams = SamplingParams(), dtype: torch.dtype = torch.float32,
                     page_size: int = 16, chunk_tokens: int | None = None) -> RankGeneration:
    """Build rank `tp.rank`'s shard and run `generate` on it; every rank of the group must call
    this with the same arguments (each forward is a sequence of all-reduces across ranks)."""
    model = build_model(source.config(), source.state_dict(), dtype, rank_device(), tp)
    gens = generate(model, prompts, params, page_size=page_size, chunk_tokens=chunk_tokens)
    return RankGeneration(tp.rank, tp.size, model.kv_spec(page_size).num_kv_heads,
                          [g.tokens for g in gens], [g.finish_reason for g in gens])


def tp_generate(source: WeightSource, prompts: Sequence[Sequence[int]], size: int,
                params: SamplingParams = SamplingParams(), dtype: torch.dtype = torch.float32,
                page_size: int = 16, chunk_tokens: int | None = None,
                timeout_s: float = DEFAULT_TIMEOUT_S) -> RankGeneration:
    """Generate with `size` local rank processes; rank 0's result (all ranks must agree)."""
    prompts = [list(p) for p in prompts]
    results: list[RankGeneration] = run_tp(
        generate_on_rank, size, source, prompts, params, dtype, page_size, chunk_tokens,
        timeout_s=timeout_s, config=source.config())
    for other in results[1:]:
        if other.tokens != results[0].tokens:
            # All-reduce hands every rank the same bits, so ranks can only diverge by a bug.
            raise TPRunError(f"TP rank {other.rank} generated {other.tokens}, rank 0 "
                             f"{results[0].tokens}: the ranks' models are out of step",
                             other.rank)
    return results[0]
