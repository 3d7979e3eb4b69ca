"""OpenAI-compatible responses: completion and chat bodies, streaming chunks as server-sent
events, usage with cached tokens (and kvtier's own field: cached tokens by tier, the five
lengths, and in a prefill/decode graph how the request went through its stages), the model
list. Plain dicts and strings, ready to send."""
from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Mapping

from kvtier.engine.handoff import HandoffStages
from kvtier.frontend.openai_requests import Role
from kvtier.engine.request import CachedTokens
from kvtier.frontend.records import PDReport
from kvtier.tiers.cache_types import RequestLengths

SSE_DONE = "data: [DONE]\n\n"


# ---------------------------------------------------------------- responses

class OpenAIFinish(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"


# aborted / no_memory / error all mean the text was cut off before the model ended it; "length"
# is the only standard value that tells a client the answer may be incomplete ("stop" would
# claim the model finished). The engine's own reason is in the server log.
_FINISH = {"stop": OpenAIFinish.STOP, "length": OpenAIFinish.LENGTH,
           "aborted": OpenAIFinish.LENGTH, "no_memory": OpenAIFinish.LENGTH,
           "error": OpenAIFinish.LENGTH}


def openai_finish_reason(reason: str | enum.Enum) -> str:
    """The engine's FinishReason (or its value, or an OpenAI value) as OpenAI's string."""
    key = reason.value if isinstance(reason, enum.Enum) else reason
    if key not in _FINISH:
        raise ValueError(f"unknown finish reason {reason!r}; expected one of {list(_FINISH)}")
    return _FINISH[key].value


def new_request_id(chat: bool) -> str:
    return f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached: CachedTokens,
          lengths: RequestLengths | None = None) -> dict:
    """OpenAI usage; cached_tokens counts prompt tokens reused from any tier. `lengths`, when
    given, is only checked against `cached` (both come from the same admission)."""
    total = cached.total
    if lengths is not None:
        assert total == lengths.prefix_len + lengths.host_loaded_length, (cached, lengths)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": total}}


def kvtier_field(cached: CachedTokens, lengths: RequestLengths,
                 pd: PDReport | None = None) -> dict:
    """The extra top-level `kvtier` field: where the cached prompt came from, the five
    lengths (docs/architecture.md invariant 4), and `pd` (`pd_report`) in a prefill/decode
    graph. OpenAI clients ignore unknown fields."""
    out: dict = {"cached_tokens": cached._asdict(), "lengths": lengths._asdict()}
    if pd is not None:
        out["pd"] = pd.to_dict()
    return out


def pd_report(mode: str, transport: str, prefill_instance: str, decode_instance: str | None,
              stages: HandoffStages, transfer_bytes: int, transfer_pages: int) -> PDReport:
    """`kvtier.pd`: how a prefill/decode graph served the request (`mode` handoff,
    recomputed or mixed), on which instances, each stage's seconds to the microsecond (None:
    it did not happen), and the KV bytes and prompt pages the hand-off moved over `transport`."""
    seconds = {k: None if v is None else round(v, 6) for k, v in stages.to_dict().items()}
    return PDReport(mode, transport, prefill_instance, decode_instance, seconds,
                    int(transfer_bytes), int(transfer_pages))


def _envelope(obj: str, request_id: str, model: str, created: int, choice: dict,
              usage_: dict | None, kvtier: dict | None, index: int = 0) -> dict:
    out = {"id": request_id, "object": obj, "created": created, "model": model,
           "choices": [{"index": index, **choice}]}
    if usage_ is not None:
        out["usage"] = usage_
    if kvtier is not None:
        out["kvtier"] = kvtier
    return out


def completion_response(request_id: str, model: str, created: int, text: str,
                        finish_reason: str | enum.Enum, usage: dict,
                        kvtier: dict | None = None, *, index: int = 0,
                        logprobs: dict | None = None) -> dict:
    choice = {"text": text, "logprobs": logprobs,
              "finish_reason": openai_finish_reason(finish_reason)}
    return _envelope("text_completion", request_id, model, created, choice, usage, kvtier,
                     index)


def chat_response(request_id: str, model: str, created: int, text: str,
                  finish_reason: str | enum.Enum, usage: dict,
                  kvtier: dict | None = None, *, index: int = 0,
                  logprobs: dict | None = None) -> dict:
    choice = {"message": {"role": Role.ASSISTANT.value, "content": text}, "logprobs": logprobs,
              "finish_reason": openai_finish_reason(finish_reason)}
    return _envelope("chat.completion", request_id, model, created, choice, usage, kvtier,
                     index)


def with_choices(response: dict, others: list[dict]) -> dict:
    """`response` (answer 0 of a request with `n` > 1) with the choices of the `others`
    (answers 1.., built the same way with their index) appended, in index order."""
    choices = response["choices"] + [c for r in others for c in r["choices"]]
    return {**response, "choices": sorted(choices, key=lambda c: c["index"])}


# ---------------------------------------------------------------- streaming

def _chunk_finish(reason: str | enum.Enum | None) -> str | None:
    return None if reason is None else openai_finish_reason(reason)


def _with_null_usage(chunk: dict, include_usage: bool) -> dict:
    """With include_usage, OpenAI sends `"usage": null` on every chunk but the last."""
    if include_usage:
        chunk["usage"] = None
    return chunk


def completion_chunk(request_id: str, model: str, created: int, text: str = "",
                     finish_reason: str | enum.Enum | None = None, *,
                     include_usage: bool = False, index: int = 0,
                     logprobs: dict | None = None) -> dict:
    choice = {"text": text, "logprobs": logprobs, "finish_reason": _chunk_finish(finish_reason)}
    chunk = _envelope("text_completion", request_id, model, created, choice, None, None, index)
    return _with_null_usage(chunk, include_usage)


def chat_chunk(request_id: str, model: str, created: int, content: str | None = None,
               finish_reason: str | enum.Enum | None = None, *, first: bool = False,
               include_usage: bool = False, index: int = 0,
               logprobs: dict | None = None) -> dict:
    """`first` adds the assistant role to the delta (OpenAI's opening chunk); the closing chunk
    has an empty delta and the finish reason."""
    delta: dict = {"role": Role.ASSISTANT.value} if first else {}
    if content is not None:
        delta["content"] = content
    choice = {"delta": delta, "logprobs": logprobs,
              "finish_reason": _chunk_finish(finish_reason)}
    chunk = _envelope("chat.completion.chunk", request_id, model, created, choice, None, None,
                      index)
    return _with_null_usage(chunk, include_usage)


def usage_chunk(request_id: str, model: str, created: int, usage: dict, *, chat: bool,
                kvtier: dict | None = None) -> dict:
    """The last chunk when stream_options.include_usage is set: no choices, just usage."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    out = {"id": request_id, "object": obj, "created": created, "model": model,
           "choices": [], "usage": usage}
    if kvtier is not None:
        out["kvtier"] = kvtier
    return out


def sse(obj: Mapping) -> str:
    """One server-sent event; compact JSON never contains a newline, so one data line."""
    return f"data: {json.dumps(obj, separators=(',', ':'), allow_nan=False)}\n\n"


def models_response(model_names: tuple[str, ...] | list[str], created: int,
                    owned_by: str = "kvtier") -> dict:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": m, "object": "model", "created": created,
                                        "owned_by": owned_by} for m in model_names]}
