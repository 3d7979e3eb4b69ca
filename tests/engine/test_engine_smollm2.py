"""SmolLM2-135M-Instruct end to end: parity with HF transformers, sensible greedy text."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_llama
from reference_generate import generate

from kvtier.engine import ModelRunner, SamplingParams
from kvtier.tiers.device_pool import DevicePool

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about caches."}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2=?"}],
]


def test_logits_match_hf_transformers(smollm2, smollm2_model) -> None:
    model = smollm2_model(torch.float32)
    hf = hf_llama(smollm2.config, smollm2.state_dict)
    for messages in PROMPTS:
        ids = smollm2.tokenizer.encode_chat(messages)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        with DevicePool(model.kv_spec(16), 8, device="cpu") as pool:
            mine = ModelRunner(model, pool).prefill(ids, 0, list(range(8)), all_logits=True)
        diff = (mine - ref).abs().max().item()
        assert diff < 1e-3, f"max logit difference {diff} on {messages[-1]['content']!r}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_capital_of_france_is_paris(smollm2, smollm2_model, dtype) -> None:
    tok = smollm2.tokenizer
    params = SamplingParams(max_new_tokens=24, stop_token_ids=tok.stop_token_ids)
    (out,) = generate(smollm2_model(dtype), [tok.encode_chat(PROMPTS[0])], params)
    assert "Paris" in tok.decode(out.tokens)
    assert out.finish_reason == "stop" and out.tokens[-1] == tok.eos_token_id


def test_batched_greedy_equals_single(smollm2, smollm2_model) -> None:
    tok = smollm2.tokenizer
    model = smollm2_model(torch.float32)
    prompts = [tok.encode_chat(m) for m in PROMPTS]
    params = SamplingParams(max_new_tokens=6, stop_token_ids=tok.stop_token_ids)
    batch = generate(model, prompts, params)
    for prompt, got in zip(prompts, batch):
        assert got.tokens == generate(model, [prompt], params)[0].tokens
