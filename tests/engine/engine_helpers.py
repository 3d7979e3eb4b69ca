"""Test helpers: run a request cold or from a cache hit, build an HF reference model."""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from kvtier.engine import ModelConfig, ModelRunner, PagedLlama
from kvtier.tiers.device_pool import DevicePool


class Run(NamedTuple):
    logits: list[torch.Tensor]  # last prompt token, then one per decode step
    tokens: list[int]           # greedy tokens


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def prefill_and_decode(runner: ModelRunner, tokens: Sequence[int], start_pos: int,
                       pages: Sequence[int], steps: int) -> Run:
    logits = [runner.prefill(tokens, start_pos, pages)]
    out = [int(logits[-1].argmax())]
    for i in range(steps):
        logits.append(runner.decode([out[-1]], [(pages, len(tokens) + i)])[0])
        out.append(int(logits[-1].argmax()))
    return Run(logits, out)


def hit_and_cold(model: PagedLlama, prefix: list[int], suffix_a: list[int], suffix_b: list[int],
                 page_size: int, chunk_tokens: int, kv_dtype: torch.dtype | None = None,
                 steps: int = 3, corrupt_hit: bool = False) -> tuple[Run, Run]:
    """Request B = prefix + suffix_b, (1) resuming from the pages request A = prefix + suffix_a
    left in the pool, (2) cold in a fresh pool with other page ids."""
    a, b = prefix + suffix_a, prefix + suffix_b
    spec = model.kv_spec(page_size, kv_dtype)
    need_b = pages_for(len(b) + steps, page_size)
    with DevicePool(spec, pages_for(len(a), page_size) + need_b, device="cpu") as pool:
        runner = ModelRunner(model, pool, chunk_tokens, deterministic=True)
        pages_a = pool.allocator.alloc(pages_for(len(a), page_size))
        runner.prefill(a, 0, pages_a)
        # A cache would match the prefix's whole pages; reuse what lies on the chunk grid.
        hit_len = runner.usable_prefix(len(prefix) // page_size * page_size, len(b))
        assert hit_len > 0
        shared = pages_a[:hit_len // page_size]
        if corrupt_hit:
            pool.kv[0, 0, shared[0], 0] += 1e-3
        hit = prefill_and_decode(runner, b, hit_len,
                                 shared + pool.allocator.alloc(need_b - len(shared)), steps)
    with DevicePool(spec, need_b, device="cpu") as pool:
        runner = ModelRunner(model, pool, chunk_tokens, deterministic=True)
        cold = prefill_and_decode(runner, b, 0, list(reversed(range(need_b))), steps)
    return hit, cold


def assert_identical(hit: Run, cold: Run) -> None:
    assert hit.tokens == cold.tokens
    for i, (x, y) in enumerate(zip(hit.logits, cold.logits)):
        assert torch.equal(x, y), f"logits differ at step {i}: max {(x - y).abs().max()}"


def _hf_shapes(config: ModelConfig) -> dict:
    """The HF config keys every architecture shares."""
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads, num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.max_position,
        rms_norm_eps=config.rms_norm_eps, tie_word_embeddings=config.tie_word_embeddings)


def hf_llama(config: ModelConfig, state: dict[str, torch.Tensor]):
    """transformers' LlamaForCausalLM with our weights (test-only dependency, nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        **_hf_shapes(config),
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta})
    model = LlamaForCausalLM(hf_config)
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    return model.eval()


def hf_gemma3(config: ModelConfig, state: dict[str, torch.Tensor]):
    """transformers' Gemma3ForCausalLM (fp32, eager attention) with our weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvtier.engine.model_config import LayerKind

    types = {LayerKind.FULL: "full_attention", LayerKind.SLIDING: "sliding_attention"}
    hf_config = Gemma3TextConfig(
        **_hf_shapes(config), query_pre_attn_scalar=round(config.scale ** -2), sliding_window=config.sliding_window,
        layer_types=[types[k] for k in config.layer_kinds],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": config.rope_theta},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": config.rope_local_theta}})
    hf_config._attn_implementation = "eager"
    with torch.device("meta"):
        model = Gemma3ForCausalLM(hf_config)
    model.to_empty(device="cpu")
    model.model.rotary_emb.__init__(hf_config)  # its inv_freq buffers were on the meta device
    model.model.embed_tokens.embed_scale = torch.tensor(config.hidden_size ** 0.5)
    result = model.load_state_dict(state, strict=False, assign=True)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= ({"lm_head.weight"} if config.tie_word_embeddings else set())
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
