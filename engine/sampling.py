"""Choosing the next token: penalties, then greedy or temperature + top-k / min-p / top-p with
a seeded generator (vLLM's order and meanings).

Why each token has a generator seed of its own (derived from the request's seed and the
token's place in the answer) instead of one generator advanced token by token: a request
that runs again after its KV was lost (a preemption, a rank restart, another instance after a
stall) continues after the tokens its client already has, and its next token must be the
one the first run would have drawn. With a seed per position, that holds wherever and
however often the answer is resumed, with nothing to carry but the tokens.
"""
from __future__ import annotations

import hashlib
import random
from collections import Counter
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from kvtier.errors import ConfigError, KvtierError

MAX_LOGPROBS = 20  # most alternatives reported per token (OpenAI's top_logprobs limit)


class SamplingError(KvtierError, RuntimeError):
    """This request's next token cannot be chosen (the model gave it no finite logit)."""


class TokenLogprob(NamedTuple):
    """A chosen token's log-probability under the model, and the `k` most likely tokens'."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token, logprob), most likely first


@dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` is greedy. `seed` makes sampling reproducible (per request).

    Penalties act on the logits before anything else, greedy included:
    `repetition_penalty` (> 0, 1 = off) divides a positive logit and multiplies a negative one
    of every token already in the prompt or the output; `presence_penalty` subtracts a fixed
    amount from every token already in the output and `frequency_penalty` that amount times its
    count there (both in [-2, 2], 0 = off). Sampling then keeps the `top_k` most likely tokens
    (0 = all), those at least `min_p` times as likely as the most likely one (0 = all), and the
    smallest head whose mass reaches `top_p`.
    """

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    # None: the model's own stop tokens (the Engine fills in EOS and <|im_end|>); (): none
    stop_token_ids: tuple[int, ...] | None = None
    seed: int | None = None
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # None: no log-probabilities; k: each chosen token's and its k most likely alternatives'
    # (the model's distribution: before penalties and temperature)
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0 = every token), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0:
            raise ConfigError(f"repetition_penalty must be > 0 (1 = off), got "
                              f"{self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ConfigError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be None or in [0, {MAX_LOGPROBS}], got "
                              f"{self.logprobs}")

    @property
    def stops(self) -> tuple[int, ...]:
        """The token ids that end generation (none when left to a model without a tokenizer)."""
        return self.stop_token_ids or ()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return (self.repetition_penalty != 1 or self.presence_penalty != 0
                or self.frequency_penalty != 0)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of the token at `position` of an answer sampled with `seed`."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class Sampler:
    """One request's sampler. It counts the tokens of the answer (`answered`: those an
    earlier run already chose, then its own: the penalties see them all) and seeds each
    draw by the request's seed and the token's position (see the module docstring). With
    `params.logprobs` set it keeps each token it chose's TokenLogprob in `logprobs`."""

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu",
                 prompt: Sequence[int] = (), answered: Sequence[int] = ()) -> None:
        self.params = params
        self.generator: torch.Generator | None = None
        self._prompt = frozenset(prompt) if params.repetition_penalty != 1 else frozenset()
        self._output: Counter[int] = Counter(int(t) for t in answered)
        self.position = len(answered)  # the answer's index of the next token
        self.logprobs: list[TokenLogprob] = []
        self.seed = params.seed if params.seed is not None else random.getrandbits(63)
        if not params.greedy:
            self.generator = torch.Generator(device=device)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from (vocab,) logits. Raises SamplingError when no logit is
        finite; otherwise always a token (an overflow of logits / temperature is the
        temperature's limit, greedy)."""
        logits = logits.float()
        finite = torch.isfinite(logits)
        if not bool(finite.any()):
            raise SamplingError("the model gave no finite logit for this request")
        if not bool(finite.all()):  # NaN never wins; +inf is the most likely token
            logits = torch.nan_to_num(logits, nan=float("-inf"),
                                      posinf=float(torch.finfo(torch.float32).max))
        token = self._choose(self._penalize(logits) if self.params.penalized else logits)
        self._output[token] += 1
        if self.params.logprobs is not None:
            self.logprobs.append(self._logprob(logits, token))
        self.position += 1
        return token

    def resume(self, token: int, logprob: TokenLogprob | None = None) -> None:
        """Continue a request whose `token` (the next one) another sampler chose (its
        prefill instance's): count it as chosen, with its log-probability when it asked."""
        self._output[token] += 1
        self.position += 1
        if self.params.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)

    def _logprob(self, logits: torch.Tensor, token: int) -> TokenLogprob:
        logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, self.params.logprobs) if self.params.logprobs else None
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
        return TokenLogprob(token, float(logp[token]), pairs)

    def _penalize(self, logits: torch.Tensor) -> torch.Tensor:
        p, logits = self.params, logits.clone()
        if p.repetition_penalty != 1:
            seen = torch.tensor(sorted(self._prompt | self._output.keys()), dtype=torch.long,
                                device=logits.device)
            if seen.numel():
                vals = logits[seen]
                logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                           vals * p.repetition_penalty)
        if self._output and (p.presence_penalty or p.frequency_penalty):
            ids = torch.tensor(list(self._output), dtype=torch.long, device=logits.device)
            counts = torch.tensor(list(self._output.values()), dtype=logits.dtype,
                                  device=logits.device)
            logits[ids] -= p.presence_penalty + p.frequency_penalty * counts
        return logits

    def _choose(self, logits: torch.Tensor) -> int:
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        scaled = logits / p.temperature
        if not bool(torch.isfinite(scaled.max())):  # a temperature too small for these
            return int(torch.argmax(logits))  # logits: its limit is greedy
        probs = torch.softmax(scaled, dim=-1)
        floor = None  # the least probability a token needs to stay (top_k, min_p)
        if p.top_k and p.top_k < probs.numel():
            floor = torch.topk(probs, p.top_k).values[-1]
        if p.min_p > 0:
            floor = torch.maximum(floor, p.min_p * probs.max()) if floor is not None \
                else p.min_p * probs.max()
        if floor is not None:
            probs = torch.where(probs >= floor, probs, torch.zeros_like(probs))
            probs = probs / probs.sum()
        assert self.generator is not None
        self.generator.manual_seed(position_seed(self.seed, self.position))
        if p.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            # Keep the smallest head of the distribution whose mass reaches top_p (>= 1 token).
            keep = sorted_probs.cumsum(-1) - sorted_probs < p.top_p
            choice = torch.multinomial(sorted_probs * keep, 1, generator=self.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))
