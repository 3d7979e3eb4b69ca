"""One answer, possibly from several instances: what the client already has, and when to give
up on an instance.

When the router declares the instance serving a request stalled, or the instance's stream
fails (its replica died, the instance stopped serving), the request is sent to another
instance, which goes on after the tokens the client already has (`SentTokens.resume`): their
KV is recomputed as part of the prompt, so the answer is never spliced from two runs and
never fails for the move. The first instance's stream is cancelled and never read again: a
late answer from it is dropped, so nothing is answered twice. A request that failed by itself
(its last item says "error") is never sent again.
"""
from __future__ import annotations

from typing import Sequence

from kvtier.engine.request import Resume
from kvtier.engine.sampling import TokenLogprob
from kvtier.errors import KvtierError


class InstanceUnavailable(KvtierError, RuntimeError):
    """No instance can serve the request now (its instance stalled or stopped, and no other
    one is live): the client should retry shortly."""


class SentTokens:
    """Token ids passed on so far and their log-probabilities (when asked); `moves` counts
    the instances the answer left."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.moves = 0

    def add(self, tokens: Sequence[int], logprobs: Sequence[TokenLogprob] | None = None) -> None:
        self.ids += [int(t) for t in tokens]
        if logprobs:
            self.logprobs += list(logprobs)

    def resume(self, with_logprobs: bool) -> Resume | None:
        """What another instance goes on after; None when nothing was passed on yet."""
        if not self.ids:
            return None
        return Resume(tuple(self.ids), tuple(self.logprobs) if with_logprobs else None)
