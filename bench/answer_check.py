"""Telling a wrong answer from a near-tie: how the soaks and the chaos bench judge an answer
against its cold reference.

By default kvtier batches requests (and a hit changes which rows share a forward), so a greedy
answer can differ from a cold run's where the model's two most likely next tokens are almost
equally likely: the last bits of a matmul decide, not the KV. Wrong KV (a torn page, another
prompt's page) moves the logits far more than that. So at the first token where an answer
differs from its reference, the reference's own top two log-probabilities there tell the cases
apart: within `tolerance` of each other, and the answer took one of the two, it is a near-tie;
otherwise it is wrong. The reference must be computed with `logprobs >= 2`
(`REFERENCE_LOGPROBS`: the top two kept).
"""
from __future__ import annotations

import enum
import logging
from typing import NamedTuple, Sequence

from kvtier.engine.request import Output
from kvtier.engine.sampling import TokenLogprob

log = logging.getLogger(__name__)

NEAR_TIE_NATS = 1e-3  # fp32 batched matmuls move a logit by ~1e-5; wrong KV by far more
REFERENCE_LOGPROBS = 2  # what a reference asks for (SamplingParams.logprobs): the top two


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


class Reference(NamedTuple):
    """A cold answer to judge others by: its tokens and, per token, the top two log-probs."""

    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None

    @classmethod
    def of(cls, out: Output) -> "Reference":
        return cls(tuple(out.tokens), out.logprobs)


def answer_words(out: Output) -> str:
    """Where an answer's prompt came from, for the log of a difference."""
    c = out.cached
    return f"{len(out.prompt)}-token prompt, {c.device}/{c.host}/{c.storage} from L1/L2/L3"


class AnswerTally:
    """What a soak counts of its answers: how many it judged, near-ties and wrong ones (each
    difference logged with where it happened, so a wrong one can be replayed)."""

    def __init__(self, tolerance: float = NEAR_TIE_NATS) -> None:
        self.tolerance = tolerance
        self.judged = self.near_ties = self.wrong = 0

    def check(self, got: Sequence[int], want: Reference, what: str = "") -> Verdict:
        verdict = judge(got, want.tokens, want.logprobs, self.tolerance)
        self.judged += 1
        if verdict is Verdict.SAME:
            return verdict
        i = first_difference(got, want.tokens)
        top = want.logprobs[i].top if want.logprobs is not None and i < len(want.logprobs) \
            else ()
        if verdict is Verdict.NEAR_TIE:
            self.near_ties += 1
            log.info("near-tie at token %d (%s): got %s, cold %s, cold's top two %s", i, what,
                     list(got), list(want.tokens), top[:2])
        else:
            self.wrong += 1
            log.error("wrong answer at token %d (%s): got %s, cold %s, cold's top two %s", i,
                      what, list(got), list(want.tokens), top[:2])
        return verdict
