"""Served answers judged against cold answers of the same model, computed in this process:
what `kvtier bench chaos` counts as the same answer, a near-tie or a wrong one.

The reference is the served model (same weights and chunk size) in the run's dtype, one
Engine with L1 only, cold for every prompt (its cache dropped first), on one thread as every
rank runs, greedy, with the top two log-probabilities of every token: bench/answer_check's
`judge` tells a near-tie from a wrong token with them.

Why branches: `judge` looks at the first difference only. After a near-tie at token i the
served answer is the model's greedy continuation of another prefix, which the prompt's cold
answer does not show; so the rest is judged against the cold answer of prompt + answer[:i+1],
and so on, at most MAX_BRANCHES times. An answer spliced from two runs (a stream whose
request was recomputed and went on differently) differs from every such continuation where
the second run took over, and is wrong there.

Served answers arrive as the bytes of each token (the OpenAI log-probabilities carry them,
not ids); `token_ids` maps them back, one id per byte string (checked at start: a
vocabulary where two ids share their bytes is refused, the mapping would be a guess).
"""
from __future__ import annotations

import logging
from typing import Callable, NamedTuple, Sequence

import torch

from kvtier.bench.answer_check import Verdict, first_difference, judge
from kvtier.config import HiCacheConfig
from kvtier.engine import Engine, SamplingParams, build_model
from kvtier.engine.request import pages_for
from kvtier.engine.sampling import TokenLogprob
from kvtier.errors import ConfigError
from kvtier.frontend import served_model
from kvtier.frontend.settings import ServeSettings
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)

MAX_BRANCHES = 4  # near-ties followed in one answer; past them the answer counts as a near-tie
TOP_LOGPROBS = 2


class Cold(NamedTuple):
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...]


class Judged(NamedTuple):
    verdict: Verdict
    at: int | None  # the token where it went wrong (WRONG), or the first near-tie


class ColdJudge:
    """Cold answers of `settings`' model in `dtype`, and served answers judged against them."""

    def __init__(self, settings: ServeSettings, dtype: torch.dtype) -> None:
        self.tokenizer = served_model.tokenizer(settings)
        source = served_model.weight_source(settings)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as every rank: a sum's last bits depend on its split
        self._threads = threads
        model = build_model(source.config(), source.state_dict(), dtype, "cpu")
        page = settings.page_size
        tokens = settings.max_prompt_tokens + settings.max_new_tokens + settings.chunk_tokens
        cache = HierarchicalCache(HiCacheConfig(page_size=page, enable_hierarchical_cache=False),
                                  model.kv_spec(page), pages_for(tokens, page) + 1, device="cpu")
        self.engine = Engine(model, cache, settings.chunk_tokens, owns_cache=True)
        self._cold: dict[tuple, Cold] = {}
        self._ids = _ids_by_bytes(self.tokenizer)

    # ---- inputs --------------------------------------------------------------------------------
    def chat_prompt(self, messages: Sequence[dict]) -> tuple[int, ...]:
        """The prompt the ingress makes of `messages` (the same tokenizer and template)."""
        return tuple(self.tokenizer.encode_chat(list(messages)))

    def token_ids(self, token_bytes: Sequence[bytes]) -> tuple[int, ...] | None:
        """The ids of an answer given as each token's bytes; None if some bytes are no token."""
        ids = tuple(self._ids.get(b, -1) for b in token_bytes)
        return None if -1 in ids else ids

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.tokenizer.stop_token_ids

    # ---- references ------------------------------------------------------------------------------
    def cold(self, prompt: Sequence[int], max_tokens: int, stops: Sequence[int]) -> Cold:
        """The greedy cold answer of `prompt` (at most `max_tokens`, ending at a stop token)."""
        key = (tuple(prompt), max_tokens, tuple(stops))
        if key not in self._cold:
            self.engine.cache.drop_unlocked()
            (out,) = self.engine.generate([list(prompt)], SamplingParams(
                max_new_tokens=max_tokens, stop_token_ids=tuple(stops),
                logprobs=TOP_LOGPROBS))
            self._cold[key] = Cold(out.tokens, out.logprobs or ())
        return self._cold[key]

    def check(self, prompt: Sequence[int], got: Sequence[int], max_tokens: int,
              stops: Sequence[int]) -> Judged:
        """`got` (a greedy answer of `prompt`) against cold answers (`check_answer`)."""
        return check_answer(self.cold, prompt, got, max_tokens, stops)

    def close(self) -> None:
        self.engine.close()
        torch.set_num_threads(self._threads)

    def __enter__(self) -> "ColdJudge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_answer(cold: Callable[[tuple[int, ...], int, tuple[int, ...]], Cold],
                 prompt: Sequence[int], got: Sequence[int], max_tokens: int,
                 stops: Sequence[int]) -> Judged:
    """`got`, a greedy answer of `prompt` (at most `max_tokens`, ending at one of `stops`),
    against `cold(prompt, max_tokens, stops)`: SAME, NEAR_TIE (every difference a near-tie,
    each one followed to the cold continuation of its own prefix) or WRONG."""
    got, prompt, stops = tuple(got), tuple(prompt), tuple(stops)
    first_tie: int | None = None
    done = 0  # tokens of `got` judged so far
    for _ in range(MAX_BRANCHES + 1):
        if done == max_tokens or (done and got[done - 1] in stops):
            break  # the answer ended where it had to, right after a near-tie
        want = cold(prompt + got[:done], max_tokens - done, stops)
        verdict = judge(got[done:], want.tokens, want.logprobs)
        if verdict is Verdict.SAME:
            break
        at = done + first_difference(got[done:], want.tokens)
        if verdict is Verdict.WRONG:
            return Judged(Verdict.WRONG, at)
        first_tie = at if first_tie is None else first_tie
        done = at + 1
    else:
        log.info("an answer took over %d near-ties; its tail is not checked", MAX_BRANCHES)
    return Judged(Verdict.SAME if first_tie is None else Verdict.NEAR_TIE, first_tie)


def _ids_by_bytes(tokenizer) -> dict[bytes, int]:
    ids: dict[bytes, int] = {}
    for i in range(tokenizer.vocab_size):
        raw = tokenizer.token_bytes(i)
        if raw in ids:
            raise ConfigError(f"tokens {ids[raw]} and {i} are both {raw!r}: the chaos bench reads "
                              "answers as token bytes and cannot tell them apart; use another "
                              "model")
        ids[raw] = i
    return ids
