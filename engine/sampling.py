"""Choosing the next token: greedy, or temperature + top-p with a seeded generator."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.errors import ConfigError


@dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` is greedy. `seed` makes sampling reproducible (per request)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    # None: the model's own stop tokens (the Engine fills in EOS and <|im_end|>); (): none
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def stops(self) -> tuple[int, ...]:
        """The token ids that end generation (none when left to a model without a tokenizer)."""
        return self.stop_token_ids or ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """One request's sampler; its generator advances with every sampled token."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            if params.seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from (vocab,) logits."""
        if self.params.greedy:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.params.temperature, dim=-1)
        if self.params.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest head of the distribution whose mass reaches top_p (>= 1 token).
            keep = sorted_probs.cumsum(-1) - sorted_probs < self.params.top_p
            choice = torch.multinomial(sorted_probs * keep, 1, generator=self.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))
