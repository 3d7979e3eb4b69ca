"""Checks of OpenAI answers that hold for every engine behind kvtier's ingress (the serve
tests of kvtier's own instances and of vLLM instances share them)."""
from __future__ import annotations

from typing import Any


def n_answers_equal_single_requests(client: Any, seed: int, **kw: Any) -> Any:
    """n=3 sampled with seeds seed, seed+1, seed+2: answer i equals the single request with
    seed+i, the prompt counted once; the n=3 answer."""
    many = client.chat.completions.create(n=3, seed=seed, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    singles = [client.chat.completions.create(seed=seed + i, **kw) for i in range(3)]
    assert [c.message.content for c in many.choices] == \
        [s.choices[0].message.content for s in singles]
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    return many


def greedy_logprobs_are_sorted_with_the_chosen_first(answer: Any, top: int) -> list:
    """One entry per answer token, `top` alternatives sorted, the chosen token the most
    likely (greedy decoding); the entries."""
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == top
        best = entry.top_logprobs[0]
        assert (best.bytes, best.logprob) == (entry.bytes, entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == \
            sorted((t.logprob for t in entry.top_logprobs), reverse=True)
    return content
