"""generate(): batched decode, sampling, stop tokens, max_new_tokens (tiny model)."""
from __future__ import annotations

import pytest
import torch
from cache_builder import build_cache
from reference_generate import generate

from kvtier.engine import Sampler, SamplingParams
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


def test_top_k_and_min_p_cut_the_tail() -> None:
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    top2 = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert {top2(logits) for _ in range(300)} == {0, 1}
    min_p = Sampler(SamplingParams(temperature=1.0, min_p=0.45, seed=0))  # >= 0.18
    assert {min_p(logits) for _ in range(300)} == {0, 1, 2}
    both = Sampler(SamplingParams(temperature=1.0, top_k=3, min_p=0.6, top_p=0.5, seed=0))
    assert {both(logits) for _ in range(100)} == {0}  # top_p of what top_k and min_p left
    everything = Sampler(SamplingParams(temperature=1.0, seed=0))
    assert {everything(logits) for _ in range(300)} == {0, 1, 2, 3}


def test_penalties_steer_away_from_seen_tokens() -> None:
    logits = torch.tensor([2.0, 1.9, -1.0, -1.2])
    assert Sampler(SamplingParams())(logits) == 0
    # repetition: token 0 is in the prompt, 2.0 / 1.2 < 1.9
    assert Sampler(SamplingParams(repetition_penalty=1.2), prompt=[0, 3])(logits) == 1
    rep = Sampler(SamplingParams(repetition_penalty=1.5), prompt=[0, 1])
    assert rep(logits) == 0  # 1.33 vs 1.27: still 0
    neg = Sampler(SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 2])
    assert neg(torch.tensor([-1.0, -1.5, -0.9, -1.6])) == 3  # negatives multiplied: -1.8 etc.
    # presence/frequency act on the output only: greedy would repeat token 0 for ever
    plain = Sampler(SamplingParams(), prompt=[0])
    assert [plain(logits) for _ in range(3)] == [0, 0, 0]
    presence = Sampler(SamplingParams(presence_penalty=0.5), prompt=[0])
    assert [presence(logits) for _ in range(3)] == [0, 1, 0]  # 1.5 vs 1.4, then both seen
    freq = Sampler(SamplingParams(frequency_penalty=0.2))
    assert [freq(logits) for _ in range(4)] == [0, 1, 0, 1]


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
    for bad in ({"top_k": -1}, {"min_p": 1.5}, {"repetition_penalty": 0},
                {"presence_penalty": 2.5}, {"frequency_penalty": -3}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ConfigError, match="larger num_pages"):
        generate(tiny_models[torch.float32], PROMPTS, SamplingParams(max_new_tokens=4), num_pages=3)


def test_logprobs_are_the_models_distribution_before_penalties() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0])
    want = torch.log_softmax(logits, -1)
    sampler = Sampler(SamplingParams(logprobs=2, repetition_penalty=1.5), prompt=[0])
    token = sampler(logits)
    assert token == 0  # greedy after the penalty: 2 / 1.5 still leads
    (lp,) = sampler.logprobs
    assert lp.token == 0 and lp.logprob == pytest.approx(float(want[0]))
    assert [t for t, _ in lp.top] == [0, 1]
    assert [v for _, v in lp.top] == pytest.approx([float(want[0]), float(want[1])])
    assert Sampler(SamplingParams(logprobs=0))(logits) == 0
    assert Sampler(SamplingParams())(logits) == 0 and Sampler(SamplingParams()).logprobs == []
    with pytest.raises(ConfigError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_an_engine_answer_carries_one_logprob_per_token(tiny_models) -> None:
    from kvtier.engine import Engine

    model = tiny_models[torch.float32]
    cache = build_cache(model.kv_spec(16), 32)
    with Engine(model, cache, owns_cache=True) as eng:
        out = eng.generate([tokens(40, 1)], SamplingParams(max_new_tokens=5, logprobs=3))[0]
        assert [lp.token for lp in out.logprobs] == list(out.tokens)
        first = torch.log_softmax(out.prefill_logits.float(), -1)
        assert out.logprobs[0].logprob == pytest.approx(float(first[out.tokens[0]]), abs=1e-5)
        assert all(len(lp.top) == 3 and lp.top[0][0] == lp.token for lp in out.logprobs)
        plain = eng.generate([tokens(40, 1)], SamplingParams(max_new_tokens=5))[0]
        assert plain.logprobs is None and plain.tokens == out.tokens
