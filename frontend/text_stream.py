"""Generated token ids to text deltas, as they stream: detokenize incrementally, cut at stop
strings.

Why not decode each new token alone: byte-level BPE splits a multi-byte character over
tokens, and a token's text can depend on its neighbours. A tokenizer with `decode_stream()`
(kvtier's: tokenizers' DecodeStream) decodes incrementally, holding an unfinished character
until a token completes it; for any other, the whole output is decoded each time and the new
part sent, a trailing replacement character (an unfinished UTF-8 sequence) held back. Either
way `finish()` decodes the whole output once, so what was sent plus the rest is exactly
`decode(ids)`.
"""
from __future__ import annotations

from typing import Any, Sequence

from kvtier.frontend.stop_strings import StopMatcher

_PARTIAL = "\ufffd"


class TextStream:
    """`push(new_ids)` -> (text to send, stopped); `finish()` -> the rest of the text."""

    def __init__(self, tokenizer: Any, stops: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._sent_chars = 0  # characters of the decoded output passed to the matcher
        self._matcher = StopMatcher(tuple(stops)) if stops else None
        self.text = ""  # everything sent so far
        self.stopped = False
        step = getattr(tokenizer, "decode_stream", None)
        self._step = step() if step is not None else None  # incremental decoding
        self._streamed = ""  # with _step: the decoded output so far

    def push(self, new_ids: Sequence[int]) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        new = [int(t) for t in new_ids]
        self.ids.extend(new)
        if self._step is not None:
            self._streamed += "".join(self._step(t) for t in new)
            return self._emit(self._streamed[self._sent_chars:], len(self._streamed))
        decoded = self.tokenizer.decode(self.ids)
        end = len(decoded)
        while end > self._sent_chars and decoded[end - 1] == _PARTIAL:
            end -= 1  # an unfinished character: wait for the token that completes it
        return self._emit(decoded[self._sent_chars:end], end)

    def finish(self) -> str:
        """The text still held back (an unfinished character, a stop-string prefix)."""
        if self.stopped:
            return ""
        decoded = self.tokenizer.decode(self.ids)
        if self._step is not None and not decoded.startswith(self._streamed):
            decoded = self._streamed  # sent text cannot be taken back: keep to what was sent
        out, _ = self._emit(decoded[self._sent_chars:], len(decoded))
        if self._matcher is not None and not self.stopped:
            rest = self._matcher.flush()
            self.text += rest
            out += rest
        return out

    def _emit(self, piece: str, end: int) -> tuple[str, bool]:
        self._sent_chars = end
        if self._matcher is None:
            self.text += piece
            return piece, False
        out, stopped = self._matcher.feed(piece)
        self.text += out
        self.stopped = stopped
        return out, stopped
