"""generate(): prompts in, tokens out, on a plain L1 pool (no hierarchy), for tests and demos.

The scheduler (with the cache, admission and continuous batching) lives elsewhere; this is
the smallest loop that exercises prefill, batched decode, sampling and stop tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from kvtier.engine.model import PagedLlama
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import Sampler, SamplingParams
from kvtier.errors import ConfigError
from kvtier.tiers.device_pool import DevicePool

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
