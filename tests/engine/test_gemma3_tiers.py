"""Gemma-3 through every tier: the tiny hybrid model (sliding layers, a 40-token window over
16-token pages) answers prompts longer than its window the same from L1, L2, L3 and another
engine on the same L3 (in deterministic mode: the cold answer, bit for bit); a hit resumed
past the window is bit-identical to a cold run; Gemma-3 270M once through L2 and L3."""
from __future__ import annotations

import pytest
import torch
from cache_builder import build_cache
from engine_helpers import assert_identical, hit_and_cold
from test_engine_tiers import serve_from_every_tier
from test_scheduler import make_cache, toks

from kvtier.engine import Engine, SamplingParams

WINDOW = 40  # tiny_hybrid_config's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_hybrid_hits_from_every_tier_equal_a_cold_run(tiny_hybrid_models, tmp_path,
                                                           dtype) -> None:
    model = tiny_hybrid_models[dtype]
    doc = toks(6 * 16, seed=6)  # 96 tokens: the window slides past most of it
    assert len(doc) > 2 * WINDOW
    prompt_a, prompt_b = doc + toks(7, seed=1), doc + toks(11, seed=2)
    with Engine(model, make_cache(model, page=16), owns_cache=True, deterministic=True) as eng:
        cold = eng.generate([prompt_b], SamplingParams(max_new_tokens=6))[0]
    assert cold.cached.total == 0
    serve_from_every_tier(model, prompt_a, prompt_b, cold, tmp_path, 16)


def test_tiny_hybrid_hits_from_every_tier_equal_the_l1_hit_by_default(tiny_hybrid_models,
                                                                      tmp_path) -> None:
    model = tiny_hybrid_models[torch.float32]
    doc = toks(5 * 16, seed=5)
    l1 = serve_from_every_tier(model, doc + toks(7, seed=1), doc + toks(11, seed=2), None,
                               tmp_path, 16, chunk_tokens=64, deterministic=False)
    assert l1.cached.device == len(doc)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pages_per_chunk", [1, 2])
def test_tiny_hybrid_hit_past_the_window_is_bit_identical(tiny_hybrid_models, dtype,
                                                          pages_per_chunk) -> None:
    """The prefix (88 tokens) is longer than the window and decode runs 8 steps further."""
    hit, cold = hit_and_cold(tiny_hybrid_models[dtype], toks(88, 1), toks(30, 2),
                             toks(21, 3), 16, 16 * pages_per_chunk, steps=8)
    assert_identical(hit, cold)


def test_gemma3_270m_through_l2_and_l3(gemma3, gemma3_model, tmp_path) -> None:
    """A 576-token document (past the 512-token window) hit from L2 and from L3 on another
    engine: the cold run's tokens and bit-identical logits (deterministic mode)."""
    from kvtier.engine.tokenizer import Tokenizer
    from kvtier.tiers.hierarchical_cache import HierarchicalCache

    tok: Tokenizer = gemma3[2]
    text = " ".join(f"Shelf {i} holds {i * 3 % 17} jars of {['jam', 'honey'][i % 2]}."
                    for i in range(120))
    doc = tok.encode_prompt(text)[:576]
    prompt = doc + tok.encode(" Which shelf holds the most jars?")
    params = SamplingParams(max_new_tokens=4, stop_token_ids=())
    page = 64

    def cache(l3: bool) -> HierarchicalCache:
        knobs = {"page_size": page, "load_back_threshold_tokens": page}
        if l3:
            knobs.update(storage_backend="file", storage_options={"root_dir": str(tmp_path)},
                         prefetch_policy="wait_complete", prefetch_threshold_tokens=page)
        return build_cache(gemma3_model.kv_spec(page), 16, model="gemma3-test",
                           deterministic=True, **knobs)

    with Engine(gemma3_model, cache(True), tokenizer=tok, owns_cache=True,
                deterministic=True) as eng:
        cold = eng.generate([prompt], params)[0]
        eng.cache.flush()
        eng.cache.storage.drain()
        eng.cache.evict_device(10**9)
        l2 = eng.generate([prompt], params)[0]
    assert cold.cached.total == 0 and l2.cached.host == len(doc)
    with Engine(gemma3_model, cache(True), tokenizer=tok, owns_cache=True,
                deterministic=True) as eng:
        l3 = eng.generate([prompt], params)[0]
    assert l3.cached.storage == len(doc)
    for hit in (l2, l3):
        assert hit.tokens == cold.tokens
        assert torch.equal(hit.prefill_logits, cold.prefill_logits)


def test_tiny_hybrid_over_two_tp_processes_answers_as_one_rank(tiny_hybrid_models) -> None:
    """Real TP (a process per rank, gloo): each rank's sliding layers mask its own KV heads'
    window; the greedy tokens of prompts past the window equal TP 1's."""
    from reference_generate import generate, tp_generate

    from kvtier.engine.model_config import tiny_hybrid_config
    from kvtier.engine.weight_sources import TinyWeights

    prompts = [toks(90, seed=9), toks(57, seed=10)]
    params = SamplingParams(max_new_tokens=8)
    tp1 = [g.tokens for g in generate(tiny_hybrid_models[torch.float32], prompts, params)]
    result = tp_generate(TinyWeights(model_config=tiny_hybrid_config()), prompts, 2, params,
                         timeout_s=120)
    assert result.num_kv_heads == 1 and result.tokens == tp1
