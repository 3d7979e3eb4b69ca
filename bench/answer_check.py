"""Telling a wrong answer from a near-tie: how the soaks and the chaos bench judge an answer
against its cold reference.

By default kvtier batches requests (and a hit changes which rows share a forward), so a greedy
answer can differ from a cold run's where the model's two most likely next tokens are almost
equally likely: the last bits of a matmul decide, not the KV. Wrong KV (a torn page, another
prompt's page) moves the logits far more than that. So at the first token where an answer
differs from its reference, the reference's own top two log-probabilities there tell the cases
apart: within `tolerance` of each other, and the answer took one of the two, it is a near-tie;
otherwise it is wrong. The reference must be computed with `logprobs >= 1` (top two kept).
"""
from __future__ import annotations

import enum
from typing import Sequence

from kvtier.engine.sampling import TokenLogprob

NEAR_TIE_NATS = 1e-3  # fp32 batched matmuls move a logit by ~1e-5; wrong KV by far more


class Verdict(enum.Enum):
    SAME = "same"
    NEAR_TIE = "near_tie"  # first difference where the reference's top two nearly tie
    WRONG = "wrong"


def first_difference(got: Sequence[int], want: Sequence[int]) -> int | None:
    """The first index where the answers differ (a longer answer differs where the shorter
    one ended); None when they are equal."""
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def judge(got: Sequence[int], want: Sequence[int],
          want_logprobs: Sequence[TokenLogprob] | None,
          tolerance: float = NEAR_TIE_NATS) -> Verdict:
    """`got` against the reference `want` (its log-probabilities, one per token, with the top
    two alternatives): SAME, NEAR_TIE or WRONG."""
    i = first_difference(got, want)
    if i is None:
        return Verdict.SAME
    if want_logprobs is None or i >= len(want_logprobs) or i >= len(got):
        return Verdict.WRONG  # the reference has no word on that position
    top = want_logprobs[i].top
    if len(top) < 2:
        return Verdict.WRONG
    (first, lp1), (second, lp2) = top[0], top[1]
    if lp1 - lp2 <= tolerance and got[i] in (first, second):
        return Verdict.NEAR_TIE
    return Verdict.WRONG
