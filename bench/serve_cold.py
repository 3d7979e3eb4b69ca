"""How often the served answers equal cold answers (`kvtier bench serve --check-cold`).

By default a hit is not bit-identical to a cold run (a matmul's rows depend on how many run
together, and hits end on any page), so greedy answers may differ from a cold run's in
near-ties. This replays every answered request of a load, each alone and cold, in the
engine's deterministic mode in this process (same model, dtype and page size as the app),
and counts the answers whose text is the same. A figure, not a pass/fail check.
"""
from __future__ import annotations

from typing import Sequence

from kvtier.config import HiCacheConfig
from kvtier.engine import Engine, SamplingParams, load_smollm2_model
from kvtier.engine.request import pages_for
from kvtier.dtypes import resolve_here
from kvtier.frontend.settings import ModelChoice, ServeSettings
from kvtier.tiers.hierarchical_cache import HierarchicalCache


def answers_equal_cold(exchanges: Sequence[tuple[tuple, str]], settings: ServeSettings,
                       max_tokens: int) -> dict | None:
    """{"compared", "equal", "fraction"} over `exchanges` ((messages, answer text) pairs);
    None for the tiny model, which has no tokenizer to template chats with."""
    if settings.model is not ModelChoice.SMOLLM2 or not exchanges:
        return None
    model, tok = load_smollm2_model(resolve_here(settings.dtype))
    prompts = [tok.encode_chat(list(messages)) for messages, _ in exchanges]
    need = max(len(p) for p in prompts) + max_tokens + settings.page_size
    config = HiCacheConfig(page_size=settings.page_size, enable_hierarchical_cache=False)
    cache = HierarchicalCache(config, model.kv_spec(settings.page_size),
                              pages_for(need, settings.page_size), device=model.device)
    with Engine(model, cache, tokenizer=tok, owns_cache=True, deterministic=True) as engine:
        equal = sum(_cold_text(engine, prompt, max_tokens).strip() == text.strip()
                    for prompt, (_, text) in zip(prompts, exchanges))
    return {"compared": len(exchanges), "equal": equal, "fraction": equal / len(exchanges)}


def _cold_text(engine: Engine, prompt: list[int], max_tokens: int) -> str:
    engine.cache.drop_unlocked()  # nothing cached: a cold run
    (out,) = engine.generate([prompt], SamplingParams(max_new_tokens=max_tokens))
    stops = set(engine.tokenizer.stop_token_ids)
    return engine.tokenizer.decode([t for t in out.tokens if t not in stops])
