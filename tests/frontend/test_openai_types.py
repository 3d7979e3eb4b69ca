"""Every response and stream chunk the server builds parses with the `openai` package's own
types, field for field (what an OpenAI SDK client does with them)."""
from __future__ import annotations

import json

import pytest

from kvtier.engine.request import CachedTokens
from kvtier.frontend import openai_responses as out
from kvtier.tiers.cache_types import RequestLengths


openai_types = pytest.importorskip("openai.types")
from openai.types import Completion, Model  # noqa: E402
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402

CACHED = CachedTokens(device=3, host=2, storage=1)
LENGTHS = RequestLengths(prefix_len=3, host_hit_length=4, host_loaded_length=3,
                        storage_hit_length=1, extend_len=5)
USAGE = out.usage(12, 4, CACHED, LENGTHS)
KVTIER = out.kvtier_field(CACHED, LENGTHS)


def wire(obj: dict) -> dict:
    """Through JSON, as a client receives it."""
    return json.loads(json.dumps(obj))


@pytest.mark.parametrize("reason, expected", [("stop", "stop"), ("length", "length")])
def test_responses_parse_as_openai_types(reason, expected):
    chat = ChatCompletion.model_validate(wire(out.chat_response(
        out.new_request_id(True), "m", 7, "Hi there", reason, USAGE, KVTIER)))
    assert chat.choices[0].message.content == "Hi there"
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == expected
    assert chat.usage.prompt_tokens_details.cached_tokens == 6
    assert chat.usage.total_tokens == 16 and chat.object == "chat.completion"
    comp = Completion.model_validate(wire(out.completion_response(
        out.new_request_id(False), "m", 7, "text", reason, USAGE, KVTIER)))
    assert comp.choices[0].text == "text" and comp.choices[0].finish_reason == expected
    assert comp.usage.completion_tokens == 4


def test_stream_chunks_parse_as_openai_types():
    rid = out.new_request_id(True)
    chunks = [out.chat_chunk(rid, "m", 7, "", first=True, include_usage=True),
              out.chat_chunk(rid, "m", 7, "Hel", include_usage=True),
              out.chat_chunk(rid, "m", 7, finish_reason="stop", include_usage=True),
              out.usage_chunk(rid, "m", 7, USAGE, chat=True, kvtier=KVTIER)]
    parsed = [ChatCompletionChunk.model_validate(wire(c)) for c in chunks]
    assert parsed[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parsed[:3]) == "Hel"
    assert parsed[2].choices[0].finish_reason == "stop"
    assert parsed[3].choices == [] and parsed[3].usage.prompt_tokens_details.cached_tokens == 6
    # Completion chunks: OpenAI streams `"finish_reason": null` until the last one, which the
    # Completion type (made for whole responses) rejects; the SDK parses stream chunks as it
    # parses any response, with construct_type, so do the same, then check the fields.
    from openai._models import construct_type

    comp = [out.completion_chunk(rid, "m", 7, "a"),
            out.completion_chunk(rid, "m", 7, finish_reason="length")]
    parsed_comp = [construct_type(type_=Completion, value=wire(c)) for c in comp]
    assert isinstance(parsed_comp[0], Completion) and parsed_comp[0].choices[0].text == "a"
    assert parsed_comp[0].choices[0].finish_reason is None
    assert Completion.model_validate(wire(comp[1])).choices[0].finish_reason == "length"
    for c in chunks:  # one SSE data line each
        line = out.sse(c)
        assert line.startswith("data: ") and line.endswith("\n\n") and line.count("\n") == 2


def test_the_model_list_parses():
    listing = wire(out.models_response(["a", "b"], 7))
    assert [Model.model_validate(m).id for m in listing["data"]] == ["a", "b"]
