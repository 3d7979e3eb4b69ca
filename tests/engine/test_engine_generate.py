"""generate(): batched decode, sampling, stop tokens, max_new_tokens (tiny model)."""
from __future__ import annotations

import pytest
import torch

from kvtier.engine import Sampler, SamplingParams, generate
from kvtier.errors import ConfigError


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [tokens(5, 1), tokens(23, 2), tokens(40, 3)]


def test_batched_generation_equals_one_prompt_at_a_time(tiny_models) -> None:
    model = tiny_models[torch.float32]
    params = SamplingParams(max_new_tokens=12)
    batch = generate(model, PROMPTS, params)
    for prompt, got in zip(PROMPTS, batch):
        (alone,) = generate(model, [prompt], params)
        assert got.tokens == alone.tokens and got.finish_reason == alone.finish_reason == "length"
        assert torch.equal(got.prefill_logits, alone.prefill_logits)
        assert len(got.tokens) == 12


def test_sampling_is_reproducible_with_a_seed(tiny_models) -> None:
    model = tiny_models[torch.float32]

    def run(seed: int) -> list[list[int]]:
        params = SamplingParams(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=seed)
        return [g.tokens for g in generate(model, PROMPTS, params)]

    assert run(7) == run(7)
    assert run(7) != run(8)


def test_tiny_top_p_is_greedy(tiny_models) -> None:
    model = tiny_models[torch.float32]
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=8))
    narrow = generate(model, PROMPTS, SamplingParams(max_new_tokens=8, temperature=1.5,
                                                     top_p=1e-6, seed=0))
    assert [g.tokens for g in greedy] == [g.tokens for g in narrow]


def test_top_p_keeps_the_nucleus() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    sampler = Sampler(SamplingParams(temperature=1.0, top_p=0.75, seed=0))
    assert {sampler(logits) for _ in range(300)} == {0, 1}


def test_stop_tokens_end_generation(tiny_models) -> None:
    model = tiny_models[torch.float32]
    (free,) = generate(model, [PROMPTS[1]], SamplingParams(max_new_tokens=10))
    k = next(i for i, t in enumerate(free.tokens) if i > 0 and t not in free.tokens[:i])
    stop = free.tokens[k]
    (stopped,) = generate(model, [PROMPTS[1]],
                          SamplingParams(max_new_tokens=10, stop_token_ids=(stop, 9999)))
    assert stopped.tokens == free.tokens[:k + 1] and stopped.finish_reason == "stop"


def test_params_are_validated(tiny_models) -> None:
    with pytest.raises(ConfigError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ConfigError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ConfigError, match="larger num_pages"):
        generate(tiny_models[torch.float32], PROMPTS, SamplingParams(max_new_tokens=4), num_pages=3)
