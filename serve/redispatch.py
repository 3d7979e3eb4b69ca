"""One answer, possibly from two instances: the tokens already sent are not sent again.

When the router declares the instance serving a request stalled, the request is sent again,
from its prompt, to another instance. Its sampling is seeded (greedy, or the seed the ingress
gave it), so the new answer starts with the tokens the client already has: `SentTokens`
checks and skips that prefix and passes on only what is new. If the new answer disagrees
with what was sent, the text would be inconsistent, so it raises `AnswerDiverged` and the
stream ends with an error instead. The first instance's stream is cancelled and never read
again: a late answer from it is dropped, so nothing is answered twice.
"""
from __future__ import annotations

from typing import Sequence

from kvtier.errors import KvtierError


class AnswerDiverged(KvtierError, RuntimeError):
    """The re-dispatched answer differs from the tokens the client already received."""


class SentTokens:
    """Token ids passed on so far; `take(new)` -> the ones not passed on before;
    `restart()` when the answer starts again from its first token on another instance."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._pos = 0  # how far the current answer has come (its replayed prefix included)
        self.restarts = 0

    def restart(self) -> None:
        self._pos = 0
        self.restarts += 1

    def take(self, tokens: Sequence[int], final: bool = False) -> list[int]:
        """`final`: these are the answer's last tokens (it must have caught up by then)."""
        new: list[int] = []
        for token in tokens:
            token = int(token)
            if self._pos < len(self.ids):
                if self.ids[self._pos] != token:
                    raise AnswerDiverged(
                        f"the request was re-sent to another instance after its first one "
                        f"stalled, and the new answer differs at token {self._pos} "
                        f"({token} instead of {self.ids[self._pos]}); retry the request")
            else:
                self.ids.append(token)
                new.append(token)
            self._pos += 1
        if final and self._pos < len(self.ids):
            raise AnswerDiverged(
                f"the request was re-sent to another instance after its first one stalled, "
                f"and the new answer ended after {self._pos} tokens, before the "
                f"{len(self.ids)} already sent; retry the request")
        return new
