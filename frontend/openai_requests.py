"""OpenAI-compatible requests, without the HTTP: parse and validate request bodies into
frozen request objects; a bad request raises `ApiError`, whose `status` and `to_body()` the
ingress returns as they are.

Everything here is plain Python so the Ray Serve ingress stays a thin shell and every rule
is testable without a server. Input is the raw body (bytes, str or a decoded dict).
Served endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models.
"""
from __future__ import annotations

import enum
import json
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence

from kvtier.engine.sampling import SamplingParams
from kvtier.errors import KvtierError
from kvtier.keys import MAX_CACHE_SALT_CHARS

log = logging.getLogger(__name__)

MAX_STOPS = 4  # OpenAI's own limit on `stop`
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 16  # `n`: answers per request
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs limit (its legacy completions allow 5; vLLM 20)
TOKEN_ID_LIMIT = 2**31  # token ids travel as int32 in most tokenizers and kernels
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
# Sampling divides the logits by the temperature, and a seen token's positive logit by the
# repetition penalty: below these, a logit overflows to inf and softmax gives NaN. A positive
# temperature below MIN_TEMPERATURE is raised to it (vLLM does the same: clients that send
# 1e-5 for "almost greedy" keep working, and 0.01 is as good as greedy); a repetition penalty
# below MIN_REPETITION_PENALTY is refused (no client convention asks for one, and raising it
# quietly would change what the client asked by orders of magnitude).
MIN_TEMPERATURE = 0.01
MIN_REPETITION_PENALTY = 0.01
# top_p keeps the smallest head of the distribution whose mass reaches it, at least the
# likeliest token; a top_p that float32 rounds to 0 would keep none. Below MIN_TOP_P it is
# raised to it: the same token is kept (the likeliest one has at least 1/vocabulary > 1e-9).
MIN_TOP_P = 1e-9


# ---------------------------------------------------------------- errors

class ErrorType(str, enum.Enum):
    """OpenAI's `error.type` values that this server emits."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    NOT_FOUND = "not_found_error"
    SERVER = "server_error"


class ApiError(KvtierError):
    """A request the server refuses; `to_body()` is the OpenAI error JSON to send with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 err_type: ErrorType = ErrorType.INVALID_REQUEST, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.err_type, self.code = ErrorType(err_type), code

    def to_body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type.value,
                          "param": self.param, "code": self.code}}


def _bad(param: str, what: str) -> ApiError:
    """A 400 whose message starts with the field, so a client sees what to fix."""
    return ApiError(400, f"{param}: {what}", param=param)


# ---------------------------------------------------------------- request types

class Role(str, enum.Enum):
    """Chat roles a plain text model can honour (no tools, so no `tool`/`function`)."""

    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


class ChatMessage(NamedTuple):
    role: Role
    content: str  # text parts already joined


@dataclass(frozen=True)
class ApiLimits:
    """What this server accepts; fixed at startup from the engine's config."""

    model_names: tuple[str, ...]
    max_prompt_tokens: int
    max_new_tokens: int
    max_body_bytes: int = 1 << 20


@dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """Fields shared by both endpoints. Defaults are OpenAI's (temperature 1, top_p 1)."""

    model: str
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stream: bool = False
    n: int = 1  # answers to the prompt, each sampled with its own seed (seed + index)
    stop: tuple[str, ...] = ()
    include_usage: bool = False  # stream_options.include_usage: a final usage-only chunk
    # Sampling beyond OpenAI's own (vLLM's and SGLang's extra fields; engine.SamplingParams)
    top_k: int = 0  # 0 (or -1 on the wire): every token
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    ignore_eos: bool = False  # the model's end tokens do not end the answer
    stop_token_ids: tuple[int, ...] = ()  # more token ids that end it
    cache_salt: str = ""  # vLLM's: only requests with the same salt (and tenant) share prefixes
    # None: no log-probabilities; k: each answer token's and its k most likely alternatives'
    logprobs: int | None = None

    def sampling(self, model_stops: Sequence[int], seed: int, index: int = 0) -> SamplingParams:
        """The engine's SamplingParams of answer `index` (of `n`); `seed` when the request
        brought none (so a redispatched request samples the same tokens). Answer i samples
        with the seed plus i."""
        stops = tuple(dict.fromkeys(self.stop_token_ids + (() if self.ignore_eos
                                                           else tuple(model_stops))))
        return SamplingParams(
            max_new_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            stop_token_ids=stops, logprobs=self.logprobs,
            seed=((self.seed if self.seed is not None else seed) + index
                  - SEED_RANGE[0]) % (SEED_RANGE[1] - SEED_RANGE[0]) + SEED_RANGE[0])


@dataclass(frozen=True, kw_only=True)
class CompletionRequest(GenerationOptions):
    prompt: str | tuple[int, ...]  # text, or token ids to use as they are

    @property
    def is_token_prompt(self) -> bool:
        return isinstance(self.prompt, tuple)


@dataclass(frozen=True, kw_only=True)
class ChatRequest(GenerationOptions):
    messages: tuple[ChatMessage, ...]


# Fields that would change what we return; any value but a harmless one is refused rather than
# silently ignored (a client asking for logprobs must not get a reply without them).
_COMMON_UNSUPPORTED: dict[str, tuple] = {"logit_bias": (None, {})}
_COMPLETION_UNSUPPORTED = {**_COMMON_UNSUPPORTED, "echo": (None, False), "best_of": (None, 1),
                           "suffix": (None, "")}
_CHAT_UNSUPPORTED = {**_COMMON_UNSUPPORTED, "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
                     "function_call": (None, "none"),
                     "response_format": (None, {"type": "text"})}


# ---------------------------------------------------------------- parsing: the body

def _decode_body(body: bytes | str | Mapping, limits: ApiLimits) -> dict:
    """The body as a dict: size first (413, before any parsing work), then strict JSON."""
    if isinstance(body, Mapping):
        return dict(body)
    size = len(body.encode() if isinstance(body, str) else body)
    if size > limits.max_body_bytes:
        raise ApiError(413, f"body: {size} bytes is over this server's limit of "
                            f"{limits.max_body_bytes} bytes", param=None)
    constants: list[str] = []  # NaN, Infinity, -Infinity: Python's json takes them, JSON not

    def constant(name: str) -> _JsonConstant:
        constants.append(name)
        return _CONSTANT

    try:
        obj = json.loads(body, parse_constant=constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise ApiError(400, f"body: not valid UTF-8 JSON ({exc})") from None
    if constants:  # they poison sampling: refused wherever they are, naming the field
        where = _path_to(obj, _CONSTANT) or "body"
        raise _bad(where, f"{constants[0]} is not valid JSON; send a finite number")
    if not isinstance(obj, dict):
        raise ApiError(400, f"body: must be a JSON object, got {type(obj).__name__}")
    return obj


class _JsonConstant:
    """What the decoder puts where a body says NaN or Infinity (then refused)."""


_CONSTANT = _JsonConstant()


def _path_to(obj: Any, target: object) -> str | None:
    """Where `target` is in decoded JSON, as a field path (`messages[0].content`); None when
    it is the whole body. Iterative: a body may nest as deep as the decoder allows."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if value is target:
            return path or None
        if isinstance(value, dict):
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def _check_unsupported(body: dict, table: dict[str, tuple]) -> None:
    bad = [k for k, harmless in table.items() if k in body and body[k] not in harmless]
    if bad:
        raise ApiError(400, f"{', '.join(bad)}: not supported by this server; remove "
                            f"{'it' if len(bad) == 1 else 'them'} or send the default",
                       param=bad[0])


def _check_model(body: dict, limits: ApiLimits) -> str:
    served = ", ".join(limits.model_names)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"required, a string; served models: {served}")
    if model not in limits.model_names:
        raise ApiError(404, f"model: {_shown(model)} is not served here; served models: {served}",
                       param="model", err_type=ErrorType.NOT_FOUND, code="model_not_found")
    return model


# ---------------------------------------------------------------- parsing: typed fields

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)  # True is an int in Python


def _shown(v: Any) -> str:
    """A client's value in an error message: short, and never the repr of a huge integer
    (Python refuses to print one past 4,300 digits)."""
    if _is_int(v) and v.bit_length() > 100:
        return f"an integer of {v.bit_length()} bits"
    try:
        text = repr(v)
    except ValueError:  # a list holding such an integer
        return f"a {type(v).__name__}"
    return text if len(text) <= 80 else text[:77] + "..."


def _int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    """An optional integer in [lo, hi]; JSON null means 'use the default'."""
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or not lo <= v <= hi:
        raise _bad(name, f"must be an integer in [{lo}, {hi}], got {_shown(v)}")
    return v


def _finite(v: Any) -> float | None:
    """A JSON number as a finite float (-0.0 as 0.0); None for anything else: booleans,
    strings such as "NaN", NaN and infinities, integers too large for a float."""
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except OverflowError:
        return None
    return f + 0.0 if math.isfinite(f) else None


def _float(body: dict, name: str, default: float, lo: float, hi: float, *,
           lo_open: bool = False) -> float:
    v = body.get(name)
    if v is None:
        return default
    f = _finite(v)
    if f is None or not (lo < f if lo_open else lo <= f) or f > hi:
        bounds = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise _bad(name, f"must be a number in {bounds}, got {_shown(v)}")
    return f


def _temperature(body: dict) -> float:
    """OpenAI's [0, 2] (0: greedy); a positive one below MIN_TEMPERATURE becomes it."""
    t = _float(body, "temperature", 1.0, 0.0, 2.0)
    if 0 < t < MIN_TEMPERATURE:
        _log_clamp_once(t)
        return MIN_TEMPERATURE
    return t


_clamp_logged: list[bool] = []


def _log_clamp_once(t: float) -> None:
    if not _clamp_logged:
        _clamp_logged.append(True)
        log.info("temperature %g raised to %g, the least this server samples with (further "
                 "such requests are not logged)", t, MIN_TEMPERATURE)


def _bool(body: Mapping, name: str, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(param or name, f"must be true or false, got {_shown(v)}")
    return v


def _text(v: str, param: str) -> str:
    """A string that is valid Unicode text. JSON's `\\ud800` escapes decode to lone surrogates,
    which no tokenizer can take (it would fail with a 500 after parsing)."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _bad(param, f"not valid Unicode: a lone surrogate {v[exc.start]!r} at "
                          f"character {exc.start}") from None
    return v


def _stops(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if (not isinstance(stops, list) or len(stops) > MAX_STOPS
            or not all(isinstance(s, str) and s for s in stops)):
        raise _bad("stop", f"must be a non-empty string or a list of at most {MAX_STOPS} "
                           f"non-empty strings, got {_shown(v)}")
    return tuple(_text(s, "stop") for s in stops)


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise _bad("stream_options", f"must be an object like {{\"include_usage\": true}}, "
                                     f"got {_shown(opts)}")
    return _bool(opts, "include_usage", "stream_options.include_usage")


def _options(body: dict, limits: ApiLimits, default_max: int, max_name: str = "max_tokens"
             ) -> dict:
    """The shared fields, checked; a dict to splat into either request type."""
    return dict(model=_check_model(body, limits), n=_int(body, "n", 1, 1, MAX_CHOICES),
                max_tokens=_int(body, max_name, default_max, 1, limits.max_new_tokens),
                temperature=_temperature(body),
                top_p=max(MIN_TOP_P, _float(body, "top_p", 1.0, 0.0, 1.0, lo_open=True)),
                seed=_int(body, "seed", None, SEED_RANGE[0], SEED_RANGE[1] - 1),
                stream=_bool(body, "stream"), stop=_stops(body),
                include_usage=_include_usage(body),
                top_k=max(0, _int(body, "top_k", 0, -1, TOKEN_ID_LIMIT)),
                min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
                repetition_penalty=_float(body, "repetition_penalty", 1.0,
                                          MIN_REPETITION_PENALTY, 2.0),
                presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
                frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
                ignore_eos=_bool(body, "ignore_eos"), stop_token_ids=_stop_token_ids(body),
                cache_salt=_cache_salt(body))


def _cache_salt(body: dict) -> str:
    v = body.get("cache_salt")
    if v is None:
        return ""
    if not isinstance(v, str) or not 1 <= len(v) <= MAX_CACHE_SALT_CHARS:
        raise _bad("cache_salt", f"must be a non-empty string of at most "
                                 f"{MAX_CACHE_SALT_CHARS} characters, got {_shown(v)}")
    return _text(v, "cache_salt")


def _stop_token_ids(body: dict) -> tuple[int, ...]:
    v = body.get("stop_token_ids")
    if v is None:
        return ()
    if not isinstance(v, list) or len(v) > MAX_STOP_TOKEN_IDS or \
            not all(_is_int(t) and 0 <= t < TOKEN_ID_LIMIT for t in v):
        raise _bad("stop_token_ids", f"must be a list of at most {MAX_STOP_TOKEN_IDS} token ids in "
                                     f"[0, {TOKEN_ID_LIMIT}), got {_shown(v)}")
    return tuple(v)


# ---------------------------------------------------------------- parsing: the endpoints

def parse_completion(body: bytes | str | Mapping, limits: ApiLimits) -> CompletionRequest:
    """POST /v1/completions. Call `check_prompt_tokens` once the prompt is tokenized."""
    obj = _decode_body(body, limits)
    _check_unsupported(obj, _COMPLETION_UNSUPPORTED)
    options = _options(obj, limits, min(16, limits.max_new_tokens))
    # legacy completions: `logprobs` is the number of alternatives (0: the chosen token's only)
    logprobs = _int(obj, "logprobs", None, 0, MAX_TOP_LOGPROBS)
    return CompletionRequest(prompt=_prompt(obj.get("prompt")), logprobs=logprobs, **options)


def _prompt(v: Any) -> str | tuple[int, ...]:
    """OpenAI's four prompt shapes minus batching: "text", [ids], ["text"], [[ids]]."""
    shapes = "a non-empty string or a non-empty list of token ids"
    if isinstance(v, list) and v and isinstance(v[0], (str, list)):
        if len(v) != 1:
            raise _bad("prompt", f"batches are not supported ({len(v)} prompts); send one "
                                 f"request per prompt")
        v = v[0]
    if isinstance(v, str) and v:
        return _text(v, "prompt")
    if isinstance(v, list) and v:
        return _token_ids(v)
    raise _bad("prompt", f"required, {shapes}, got {_shown(v)}")


def _token_ids(ids: list) -> tuple[int, ...]:
    for i, t in enumerate(ids):
        if not _is_int(t) or not 0 <= t < TOKEN_ID_LIMIT:
            raise _bad(f"prompt[{i}]", f"token ids must be integers in [0, {TOKEN_ID_LIMIT}), "
                                       f"got {_shown(t)}")
    return tuple(ids)


def parse_chat(body: bytes | str | Mapping, limits: ApiLimits) -> ChatRequest:
    """POST /v1/chat/completions. Without a max, a reply may use up to `max_new_tokens`
    (OpenAI's chat has no small default, unlike completions' 16)."""
    obj = _decode_body(body, limits)
    _check_unsupported(obj, _CHAT_UNSUPPORTED)
    name = "max_tokens"
    if obj.get("max_completion_tokens") is not None:  # the newer name of the same limit
        if _int(obj, "max_tokens", None, 1, limits.max_new_tokens) not in (
                None, obj["max_completion_tokens"]):
            raise _bad("max_completion_tokens", "conflicts with max_tokens; send only one")
        name = "max_completion_tokens"
    options = _options(obj, limits, limits.max_new_tokens, name)
    return ChatRequest(messages=_messages(obj.get("messages")), logprobs=_chat_logprobs(obj),
                       **options)


def _chat_logprobs(body: dict) -> int | None:
    """Chat's `logprobs` (true: each answer token's) and `top_logprobs` (that many
    alternatives, which needs logprobs true)."""
    top = _int(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top:
            raise _bad("top_logprobs", "needs logprobs: true")
        return None
    return top or 0


def parse_messages(v: Any) -> tuple[ChatMessage, ...]:
    """Chat messages as a chat completion's `messages` field takes them (400s name the field)."""
    return _messages(v)


def _messages(v: Any) -> tuple[ChatMessage, ...]:
    if not isinstance(v, list) or not v:
        raise _bad("messages", f"required, a non-empty list of {{\"role\", \"content\"}} "
                               f"objects, got {_shown(v)}")
    return tuple(_message(m, f"messages[{i}]") for i, m in enumerate(v))


def _message(m: Any, where: str) -> ChatMessage:
    if not isinstance(m, dict):
        raise _bad(where, f"must be an object with role and content, got {_shown(m)}")
    roles = ", ".join(r.value for r in Role)
    try:
        role = Role(m.get("role"))
    except ValueError:
        raise _bad(f"{where}.role",
                   f"must be one of {roles}, got {_shown(m.get('role'))}") from None
    return ChatMessage(role, _content(m.get("content"), f"{where}.content"))


def _content(v: Any, where: str) -> str:
    """A string, or a list of text parts joined (images and audio are not supported)."""
    if isinstance(v, str):
        return _text(v, where)
    if not isinstance(v, list):
        raise _bad(where, f"must be a string or a list of text parts, got {_shown(v)}")
    texts = []
    for j, part in enumerate(v):
        if not isinstance(part, dict) or part.get("type") != "text":
            got = part.get("type") if isinstance(part, dict) else part
            raise _bad(f"{where}[{j}].type",
                       f"only \"text\" parts are supported, got {_shown(got)}")
        if not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}].text", f"must be a string, got {_shown(part.get('text'))}")
        texts.append(_text(part["text"], f"{where}[{j}].text"))
    return "".join(texts)


def check_prompt_tokens(token_ids: list[int] | tuple[int, ...], limits: ApiLimits,
                        vocab_size: int, param: str = "prompt") -> None:
    """The checks that need the tokenized prompt (its length, the model's vocabulary)."""
    n = len(token_ids)
    if n == 0:
        raise _bad(param, "the prompt is empty after tokenization; send some text")
    if n > limits.max_prompt_tokens:
        raise ApiError(400, f"{param}: the prompt is {n} tokens, over this server's limit of "
                            f"{limits.max_prompt_tokens} (max_prompt_tokens); shorten it",
                       param=param, code="context_length_exceeded")
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise _bad(f"{param}[{i}]", f"token id {t} is outside the model's vocabulary "
                                        f"[0, {vocab_size})")
