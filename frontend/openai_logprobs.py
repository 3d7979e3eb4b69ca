"""OpenAI's `logprobs` objects, from the engine's per-token log-probabilities.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
"bytes"}]}]}`. Legacy completions: `{"tokens", "token_logprobs", "top_logprobs" (one
token -> logprob object per token), "text_offset"}`. A token's text is its bytes decoded
(a byte-level token that holds part of a character reads as U+FFFD there; its `bytes` are
exact). The log-probabilities are the model's distribution, before penalties and temperature.

Entries are the engine's `TokenLogprob`s, as the instances stream them (`AnswerItem`).
"""
from __future__ import annotations

from typing import Any, Protocol, Sequence


class TokenBytes(Protocol):
    def token_bytes(self, token_id: int) -> bytes: ...


def _piece(tokenizer: TokenBytes, token_id: int) -> tuple[str, list[int]]:
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="replace"), list(raw)


def chat_logprobs(entries: Sequence[Any], tokenizer: TokenBytes) -> dict:
    """Chat's `choices[i].logprobs` for the answer tokens `entries`."""
    content = []
    for token, logprob, top in entries:
        text, raw = _piece(tokenizer, token)
        alternatives = []
        for alt, alt_logprob in top:
            alt_text, alt_raw = _piece(tokenizer, alt)
            alternatives.append({"token": alt_text, "logprob": alt_logprob, "bytes": alt_raw})
        content.append({"token": text, "logprob": logprob, "bytes": raw,
                        "top_logprobs": alternatives})
    return {"content": content}


def completion_logprobs(entries: Sequence[Any], tokenizer: TokenBytes,
                        text_offset: int = 0) -> dict:
    """Legacy completions' `choices[i].logprobs` for the answer tokens `entries`, whose text
    starts `text_offset` characters into the answer."""
    tokens, logprobs, tops, offsets = [], [], [], []
    for token, logprob, top in entries:
        text, _ = _piece(tokenizer, token)
        tokens.append(text)
        logprobs.append(logprob)
        tops.append({_piece(tokenizer, alt)[0]: alt_logprob for alt, alt_logprob in top})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": offsets}
