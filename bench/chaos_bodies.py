"""The adversarial request bodies of `kvtier bench chaos`: OpenAI bodies with extreme values,
reproducible from a seed.

Each body is a valid chat or completion body with one to three fields replaced by an
extreme value (out of range, of the wrong type, at a limit, huge), or a body that is no
request at all (empty, not JSON, deeply nested, over the size limit). Some of them are
valid (a limit is allowed): the server must answer every one, with a 200 or a 4xx in
OpenAI's error shape, never a 5xx, and keep serving the others.
"""
from __future__ import annotations

import json
import random
from typing import NamedTuple

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
MAX_ANSWER_TOKENS = 8  # a valid body's answer stays short: the bodies probe, they do not load


class Body(NamedTuple):
    path: str
    data: bytes


class Limits(NamedTuple):
    """What the server accepts, so that values can sit at, below and past each limit."""

    model: str
    vocab_size: int
    max_prompt_tokens: int
    max_new_tokens: int
    max_body_bytes: int


def _extremes(lim: Limits) -> dict[str, list]:
    """Field -> values to put there; the ones at a limit are valid, the rest not."""
    huge = [2**63, -(2**63) - 1, 2**64, 1e308, -1e308]
    return {
        "model": ["", "other-model", None, 3, [lim.model], lim.model * 50],
        "max_tokens": [0, -1, lim.max_new_tokens + 1, 1.5, "8", True, None, *huge],
        "temperature": [-1e-9, 2.0, 1e-30, 1e308, "0", [0], None],
        "top_p": [0, -0.0, 1e-300, 1.0000001, 2, "1"],
        "top_k": [-1, 0, 1, 2**40, -2, 1.5],
        "min_p": [1.0, 1.0001, -0.1, 0.999999],
        "n": [0, 17, 16.5, True, "2", 2**40, -1],
        "seed": [-(2**63), 2**64 - 1, 2**64, -(2**63) - 1, 1.0, "7"],
        "stop": ["", [""] * 4, ["a"] * 5, "\ud800", ["x" * 5000], [None], 7],
        "stream": ["true", 1, None, [True]],
        "stream_options": [{"include_usage": "yes"}, [], "x", {"include_usage": True}],
        "presence_penalty": [2.0, 2.0000001, -2.0, -3, 1e9],
        "frequency_penalty": [-2.0, 2.5, "1"],
        "repetition_penalty": [0, -1, 1e-9, 1e9, 2**31],
        "logprobs": [True, 21, -1, "yes", 20, 0, None],
        "top_logprobs": [21, -1, 20, 0, 2**40],
        "ignore_eos": ["yes", 1, True],
        "stop_token_ids": [[-1], [lim.vocab_size], [2**40], list(range(65)), "1"],
        "cache_salt": ["x" * 10_000, 7, "\u0000", "ok"],
        "logit_bias": [{"1": 100}, {}],
        "tools": [[{"type": "function"}], []],
        "response_format": [{"type": "json_object"}],
        "prompt": [[], [-1], [lim.vocab_size], [2**31], [[1, 2]], "", [0] * (lim.max_prompt_tokens
                   + 1), "word " * (lim.max_prompt_tokens + 10), [True], ["a", 1],
                   [lim.vocab_size - 1] * min(lim.max_prompt_tokens, 64)],
        "messages": [[], [{"role": "tool", "content": "x"}], [{"role": "user"}],
                     [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                     [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                     [{"role": 5, "content": "x"}], "hello",
                     [{"role": "user", "content": "word " * (lim.max_prompt_tokens + 10)}]],
    }


def _malformed(rng: random.Random, lim: Limits) -> bytes:
    return rng.choice([
        b"", b"{", b"null", b"[]", b"\xff\xfe{", b"[" * 50_000, b'{"model": ',
        b"{" + b" " * (lim.max_body_bytes + 1) + b"}",
        bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64))),
        b'{"model": "%s", "prompt": "x", "temperature": NaN}' % lim.model.encode(),
        b'{"model": "%s", "prompt": "x", "max_tokens": 1e999}' % lim.model.encode(),
        json.dumps(rng.choice([1, "x", 1.5, True])).encode(),
    ])


def adversarial_body(rng: random.Random, lim: Limits) -> Body:
    """One adversarial body: usually a valid one with extreme fields, else garbage."""
    path = rng.choice([CHAT, COMPLETIONS])
    if rng.random() < 0.2:
        return Body(path, _malformed(rng, lim))
    body: dict = {"model": lim.model, "max_tokens": rng.randrange(1, MAX_ANSWER_TOKENS + 1)}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "Say something about the sea."}]
    else:
        body["prompt"] = "Once upon a time"
    table = _extremes(lim)
    fields = [f for f in table if (f != "prompt" or path == COMPLETIONS)
              and (f != "messages" or path == CHAT)]
    for field in rng.sample(fields, rng.randrange(1, 4)):
        body[field] = rng.choice(table[field])
    return Body(path, json.dumps(body).encode())
