"""Through the Engine: a request served from L1, L2 (after L1 eviction) and L3 (another cache
on the same file root, or this one after L1 and L2 eviction). In deterministic mode each gives
the cold run's greedy tokens and bit-identical last-prompt-token logits; by default each gives
the L1 hit's tokens and bit-identical logits (the pages' bytes are the same in every tier)."""
from __future__ import annotations

import pytest
import torch
from test_scheduler import assert_no_leaks, check_lengths, make_cache, toks

from kvtier.config import HiCacheConfig
from kvtier.engine import Engine, Output, SamplingParams

PARAMS = SamplingParams(max_new_tokens=6)


def assert_same(hit: Output, cold: Output) -> None:
    assert hit.tokens == cold.tokens
    assert torch.equal(hit.prefill_logits, cold.prefill_logits), \
        f"max logit difference {(hit.prefill_logits - cold.prefill_logits).abs().max()}"
    check_lengths(hit)


def serve_from_every_tier(model, prompt_a, prompt_b, cold: Output | None, l3_dir, page: int,
                          chunk_tokens: int | None = None, tokenizer=None,
                          deterministic: bool = True) -> Output:
    """Warm with A, then serve B from L1, L2, L3 (same cache), L3 (a second cache); each
    equals `cold`, or (None) the L1 hit, which it returns."""
    cache = make_cache(model, l3_dir=l3_dir, page=page, deterministic=deterministic)
    with Engine(model, cache, chunk_tokens, tokenizer=tokenizer, owns_cache=True,
                deterministic=deterministic) as eng:
        eng.generate([prompt_a], PARAMS)
        l1 = eng.generate([prompt_b], PARAMS)[0]
        assert l1.cached.device > 0 and l1.cached.host == 0
        cold = cold or l1
        assert_same(l1, cold)

        cache.flush()  # write-through copies land in L2
        cache.evict_device(10**9)
        l2 = eng.generate([prompt_b], PARAMS)[0]
        assert l2.cached.device == 0 and l2.cached.host > 0 and l2.cached.storage == 0
        assert_same(l2, cold)

        cache.flush()
        cache.storage.drain()  # L2 -> L3 backups land
        cache.evict_device(10**9)
        cache.tree.evict_host(10**9)  # nothing local is left: L3 is the only copy
        l3 = eng.generate([prompt_b], PARAMS)[0]
        assert l3.cached.device == 0 and l3.cached.storage > 0
        assert_same(l3, cold)
        assert_no_leaks(cache)
    other = make_cache(model, l3_dir=l3_dir, page=page, deterministic=deterministic)
    with Engine(model, other, chunk_tokens, tokenizer=tokenizer, owns_cache=True,
                deterministic=deterministic) as eng:
        l3 = eng.generate([prompt_b], PARAMS)[0]
        assert l3.cached.device == 0 and l3.cached.host == 0 and l3.cached.storage > 0
        assert_same(l3, cold)
        assert_no_leaks(other)
    return cold


@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_hits_from_every_tier_equal_a_cold_run(tiny_models, tmp_path, dtype, page) -> None:
    model = tiny_models[dtype]
    doc = toks(3 * page, seed=page)
    prompt_a, prompt_b = doc + toks(7, seed=1), doc + toks(11, seed=2)
    with Engine(model, make_cache(model, page=page), owns_cache=True, deterministic=True) as eng:
        cold = eng.generate([prompt_b], PARAMS)[0]  # never saw `doc`
    assert cold.cached.total == 0
    serve_from_every_tier(model, prompt_a, prompt_b, cold, tmp_path, page)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_hits_from_every_tier_equal_the_l1_hit_by_default(tiny_models, tmp_path,
                                                               dtype) -> None:
    """Default mode: 64-token chunks over 16-token pages, a hit that ends off that grid (at
    page 5): L2 and L3 give exactly what L1 gives."""
    model = tiny_models[dtype]
    doc = toks(5 * 16, seed=5)
    l1 = serve_from_every_tier(model, doc + toks(7, seed=1), doc + toks(11, seed=2), None,
                               tmp_path, 16, chunk_tokens=64, deterministic=False)
    assert l1.cached.device == len(doc)


def test_smollm2_hits_from_every_tier_equal_a_cold_run(tmp_path) -> None:
    """The builder, text prompts, deterministic mode (which computes one-page chunks whatever
    chunk size is asked)."""
    config = HiCacheConfig(page_size=16, load_back_threshold_tokens=16)
    with Engine.smollm2(config, device_pages=32, dtype=torch.bfloat16, chunk_tokens=32,
                        deterministic=True) as eng:
        tok = eng.tokenizer
        doc = "Caches keep what was computed so that it need not be computed again. " * 3
        prompt_a = tok.encode_chat([{"role": "user", "content": doc + "Summarize."}])
        prompt_b = tok.encode_chat([{"role": "user", "content": doc + "What do caches keep?"}])
        cold = eng.generate([prompt_b], PARAMS)[0]
        assert cold.text and cold.cached.total == 0
        text = eng.generate(["The capital of France is"], SamplingParams(max_new_tokens=3))[0]
        assert text.prompt == tuple(tok.encode("The capital of France is")) and text.text
        serve_from_every_tier(eng.model, prompt_a, prompt_b, cold, tmp_path, 16,
                              chunk_tokens=32, tokenizer=tok)
