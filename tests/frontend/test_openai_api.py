"""The OpenAI-compatible request parsing, response shapes and stop-string cutting."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.engine.request import CachedTokens
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import KvtierError
from kvtier.frontend import openai_responses as api
from kvtier.frontend.openai_requests import (
    ApiError, ApiLimits, ChatRequest, CompletionRequest, ErrorType, Role, check_prompt_tokens,
    parse_chat, parse_completion)
from kvtier.frontend.openai_responses import SSE_DONE

from kvtier.frontend.stop_strings import StopMatcher
from kvtier.tiers.cache_types import RequestLengths

LIMITS = ApiLimits(model_names=("smol", "tiny"), max_prompt_tokens=100, max_new_tokens=64,
                   max_body_bytes=4096)
CACHED = CachedTokens(device=3, host=2, storage=1)
LENGTHS = RequestLengths(prefix_len=3, host_hit_length=4, host_loaded_length=3,
                        storage_hit_length=1, extend_len=5)


def comp(**fields):
    return {"model": "smol", "prompt": "hi", **fields}


def chat(**fields):
    return {"model": "smol", "messages": [{"role": "user", "content": "hi"}], **fields}


def refused(parse, body, status=400):
    with pytest.raises(ApiError) as info:
        parse(body, LIMITS)
    assert info.value.status == status
    return info.value


# ---------------------------------------------------------------- good requests

def test_completion_defaults():
    req = parse_completion(json.dumps(comp()).encode(), LIMITS)
    assert req == CompletionRequest(model="smol", prompt="hi", max_tokens=16, temperature=1.0,
                                    top_p=1.0, seed=None, stream=False, stop=(),
                                    include_usage=False)
    assert not req.is_token_prompt


def test_completion_all_fields():
    body = comp(max_tokens=8, temperature=0, top_p=0.5, seed=7, stream=True, stop=["\n", "##"],
                n=1, stream_options={"include_usage": True}, user="u1", logprobs=None,
                echo=False, best_of=1, some_extension={"x": 1}, frequency_penalty=0)
    req = parse_completion(json.dumps(body), LIMITS)
    assert (req.max_tokens, req.temperature, req.top_p, req.seed) == (8, 0.0, 0.5, 7)
    assert req.stream and req.include_usage and req.stop == ("\n", "##")


@pytest.mark.parametrize("prompt, expected", [
    ("text", "text"), (["text"], "text"), ([1, 2, 3], (1, 2, 3)), ([[4, 5]], (4, 5)), ([0], (0,)),
])
def test_prompt_shapes(prompt, expected):
    req = parse_completion(comp(prompt=prompt), LIMITS)
    assert req.prompt == expected
    assert req.is_token_prompt == isinstance(expected, tuple)


def test_null_fields_mean_default():
    req = parse_completion(comp(max_tokens=None, temperature=None, stop=None, seed=None, n=None,
                                stream=None, stream_options=None), LIMITS)
    assert (req.max_tokens, req.temperature, req.stop, req.stream) == (16, 1.0, (), False)


def test_single_stop_string_and_small_limit():
    assert parse_completion(comp(stop="END"), LIMITS).stop == ("END",)
    small = ApiLimits(("smol",), 10, max_new_tokens=4)
    assert parse_completion(comp(), small).max_tokens == 4


def test_chat_parses_messages_and_parts():
    body = {"model": "tiny", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "", "name": "bot"}]}
    req = parse_chat(body, LIMITS)
    assert isinstance(req, ChatRequest) and req.model == "tiny"
    assert req.messages == (("system", "be brief"), ("user", "ab"), ("assistant", ""))
    assert req.messages[1].role is Role.USER
    assert req.max_tokens == LIMITS.max_new_tokens  # chat has no small default


def test_chat_max_completion_tokens_alias():
    assert parse_chat(chat(max_completion_tokens=5), LIMITS).max_tokens == 5
    assert parse_chat(chat(max_completion_tokens=5, max_tokens=5), LIMITS).max_tokens == 5
    assert parse_chat(chat(max_tokens=6), LIMITS).max_tokens == 6
    assert parse_chat(chat(tools=[], tool_choice="none", logprobs=False,
                           response_format={"type": "text"}), LIMITS).model == "smol"


# ---------------------------------------------------------------- bad requests

@pytest.mark.parametrize("body, field", [
    (b"{not json", "body"), (b'"a string"', "body"), (b"[1, 2]", "body"), (b"\xff\xfe\x00", "body"),
    (b'{"model": "smol", "prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"model": "smol", "prompt": "x", "temperature": Infinity}', "Infinity"),
    (b'{"model": "smol", "prompt": "x", "top_p": 1e400}', "top_p"),
])
def test_malformed_bodies(body, field):
    err = refused(parse_completion, body)
    assert field in err.message


def test_body_too_large():
    err = refused(parse_completion, json.dumps(comp(prompt="x" * 5000)), status=413)
    assert "4096" in err.message and "body" in err.message


def test_unknown_and_missing_model():
    err = refused(parse_completion, comp(model="gpt-4"), status=404)
    assert err.param == "model" and "smol, tiny" in err.message and err.code == "model_not_found"
    assert err.to_body()["error"]["type"] == "not_found_error"
    err = refused(parse_chat, {"messages": [{"role": "user", "content": "x"}]})
    assert err.param == "model" and "smol" in err.message


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ""}, "prompt"), ({"prompt": []}, "prompt"), ({"prompt": None}, "prompt"),
    ({"prompt": 5}, "prompt"), ({"prompt": [""]}, "prompt"), ({"prompt": [[]]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [[1], [2]]}, "prompt"),
    ({"prompt": [1, -1]}, "prompt[1]"), ({"prompt": [1, 2**31]}, "prompt[1]"),
    ({"prompt": [True]}, "prompt[0]"), ({"prompt": [1.0]}, "prompt[0]"),
    ({"prompt": [1, "a"]}, "prompt[1]"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": 65}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"max_tokens": 8.0}, "max_tokens"),
    ({"max_tokens": "8"}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"temperature": True}, "temperature"), ({"temperature": "1"}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"seed": 1.5}, "seed"), ({"seed": False}, "seed"), ({"seed": 2**64}, "seed"),
    ({"stream": 1}, "stream"), ({"stream": "true"}, "stream"),
    ({"stop": ""}, "stop"), ({"stop": ["a", ""]}, "stop"), ({"stop": ["a"] * 5}, "stop"),
    ({"stop": 3}, "stop"), ({"stop": [1]}, "stop"),
    ({"n": 17}, "n"), ({"n": True}, "n"), ({"n": 0}, "n"),
    ({"stream_options": True}, "stream_options"),
    ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
    ({"echo": True}, "echo"), ({"best_of": 2}, "best_of"),
    ({"suffix": "end"}, "suffix"), ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": "1"}, "frequency_penalty"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"stop_token_ids": [True]}, "stop_token_ids"),
])
def test_completion_field_errors(fields, param):
    err = refused(parse_completion, comp(**fields))
    assert err.param == param
    assert err.message.startswith(param) or param in err.message
    assert err.to_body() == {"error": {"message": err.message, "type": "invalid_request_error",
                                       "param": param, "code": None}}


def test_sampling_fields_reach_the_engine():
    req = parse_completion(comp(top_k=-1, min_p=0.05, repetition_penalty=1.1,
                                presence_penalty=0.5, frequency_penalty=-0.5,
                                stop_token_ids=[7, 2], seed=3, max_tokens=9), LIMITS)
    s = req.sampling(model_stops=(2, 0), seed=99)
    assert s == SamplingParams(max_new_tokens=9, temperature=1.0, top_p=1.0, top_k=0,
                               min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
                               frequency_penalty=-0.5, stop_token_ids=(7, 2, 0), seed=3,
                               logprobs=None)
    free = parse_chat(chat(ignore_eos=True, top_k=5), LIMITS).sampling((2, 0), seed=99)
    assert free.stop_token_ids == () and free.top_k == 5 and free.seed == 99


def test_several_unsupported_fields_are_all_named():
    err = refused(parse_completion, comp(echo=True, suffix="x", best_of=2))
    assert all(f in err.message for f in ("echo", "suffix", "best_of"))


@pytest.mark.parametrize("fields, param", [
    ({"messages": []}, "messages"), ({"messages": None}, "messages"),
    ({"messages": "hi"}, "messages"), ({"messages": ["hi"]}, "messages[0]"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": "ok"},
                   {"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[1].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": ["raw"]}]}, "messages[0].content[0].type"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"max_completion_tokens": 100}, "max_completion_tokens"),
    ({"max_completion_tokens": 5, "max_tokens": 6}, "max_completion_tokens"),
    ({"max_tokens": 65}, "max_tokens"), ({"temperature": 3}, "temperature"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"logprobs": 1}, "logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"response_format": {"type": "json_object"}},
                                            "response_format"),
    ({"n": 3.0}, "n"),
])
def test_chat_field_errors(fields, param):
    err = refused(parse_chat, chat(**fields))
    assert err.param == param and param in err.message


def test_role_error_lists_allowed_roles():
    err = refused(parse_chat, chat(messages=[{"role": "developer", "content": "x"}]))
    assert all(r in err.message for r in ("system", "user", "assistant"))


def test_check_prompt_tokens():
    check_prompt_tokens([1, 2, 3], LIMITS, vocab_size=10)
    with pytest.raises(ApiError) as info:
        check_prompt_tokens([], LIMITS, 10)
    assert info.value.status == 400 and "empty" in info.value.message
    with pytest.raises(ApiError) as info:
        check_prompt_tokens(list(range(101)), LIMITS, 1000, param="messages")
    err = info.value
    assert err.param == "messages" and "101" in err.message and "100" in err.message
    assert err.code == "context_length_exceeded"
    with pytest.raises(ApiError) as info:
        check_prompt_tokens([1, 10], LIMITS, 10)
    assert info.value.param == "prompt[1]" and "10" in info.value.message


def test_api_error_is_a_kvtier_error():
    err = ApiError(401, "bad key", err_type=ErrorType.AUTHENTICATION)
    assert isinstance(err, KvtierError) and str(err) == "bad key"
    assert err.to_body()["error"]["type"] == "authentication_error"


# ---------------------------------------------------------------- responses

def test_usage_and_kvtier_field():
    u = api.usage(11, 4, CACHED, LENGTHS)
    assert u == {"prompt_tokens": 11, "completion_tokens": 4, "total_tokens": 15,
                 "prompt_tokens_details": {"cached_tokens": 6}}
    kv = api.kvtier_field(CACHED, LENGTHS)
    assert kv == {"cached_tokens": {"device": 3, "host": 2, "storage": 1, "peer": 0},
                  "lengths": {"prefix_len": 3, "host_hit_length": 4, "host_loaded_length": 3,
                              "storage_hit_length": 1, "extend_len": 5}}


@pytest.mark.parametrize("reason, expected", [
    ("stop", "stop"), ("length", "length"), ("aborted", "length"), ("no_memory", "length")])
def test_finish_reason_mapping(reason, expected):
    assert api.openai_finish_reason(reason) == expected
    import enum
    assert api.openai_finish_reason(enum.Enum("R", {"X": reason}).X) == expected


def test_finish_reason_unknown():
    with pytest.raises(ValueError, match="weird"):
        api.openai_finish_reason("weird")


def test_completion_response_shape():
    u = api.usage(2, 1, CACHED)
    r = api.completion_response("cmpl-1", "smol", 123, "hello", "no_memory", u,
                                api.kvtier_field(CACHED, LENGTHS))
    assert set(r) == {"id", "object", "created", "model", "choices", "usage", "kvtier"}
    assert r["object"] == "text_completion" and r["created"] == 123
    assert r["choices"] == [{"index": 0, "text": "hello", "logprobs": None,
                             "finish_reason": "length"}]
    assert "kvtier" not in api.completion_response("c", "smol", 1, "", "stop", u)


def test_chat_response_shape():
    r = api.chat_response("chatcmpl-1", "smol", 5, "hi there", "stop", api.usage(2, 2, CACHED))
    assert set(r) == {"id", "object", "created", "model", "choices", "usage"}
    assert r["object"] == "chat.completion"
    assert r["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "hi there"},
                             "logprobs": None, "finish_reason": "stop"}]


def test_chat_stream_chunks():
    first = api.chat_chunk("c", "smol", 1, first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [{"index": 0, "delta": {"role": "assistant"}, "logprobs": None,
                                 "finish_reason": None}]
    body = api.chat_chunk("c", "smol", 1, "tok", include_usage=True)
    assert body["choices"][0]["delta"] == {"content": "tok"} and body["usage"] is None
    last = api.chat_chunk("c", "smol", 1, finish_reason="length")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert "usage" not in last
    u = api.usage_chunk("c", "smol", 1, api.usage(1, 1, CACHED), chat=True,
                        kvtier=api.kvtier_field(CACHED, LENGTHS))
    assert u["choices"] == [] and u["usage"]["total_tokens"] == 2
    assert u["object"] == "chat.completion.chunk" and "kvtier" in u


def test_completion_stream_chunks():
    c = api.completion_chunk("cmpl", "smol", 1, "ab")
    assert set(c) == {"id", "object", "created", "model", "choices"}
    assert c["object"] == "text_completion"
    assert c["choices"] == [{"index": 0, "text": "ab", "logprobs": None, "finish_reason": None}]
    end = api.completion_chunk("cmpl", "smol", 1, finish_reason="stop", include_usage=True)
    assert end["choices"][0]["finish_reason"] == "stop" and end["usage"] is None
    u = api.usage_chunk("cmpl", "smol", 1, api.usage(1, 1, CACHED), chat=False)
    assert u["object"] == "text_completion" and "kvtier" not in u


def test_sse_framing():
    event = api.sse({"text": "a\nb", "x": 1})
    assert event.startswith("data: ") and event.endswith("\n\n") and event.count("\n") == 2
    assert json.loads(event[len("data: "):]) == {"text": "a\nb", "x": 1}
    assert SSE_DONE == "data: [DONE]\n\n"


def test_models_response_and_ids():
    r = api.models_response(("smol", "tiny"), 99)
    assert r == {"object": "list", "data": [
        {"id": "smol", "object": "model", "created": 99, "owned_by": "kvtier"},
        {"id": "tiny", "object": "model", "created": 99, "owned_by": "kvtier"}]}
    assert api.new_request_id(chat=True).startswith("chatcmpl-")
    assert api.new_request_id(chat=False).startswith("cmpl-")


# ---------------------------------------------------------------- stop strings

def run_matcher(stops, deltas):
    m = StopMatcher(stops)
    out, stopped = [], False
    for d in deltas:
        emit, stopped = m.feed(d)
        out.append(emit)
    if not stopped:
        out.append(m.flush())
    return "".join(out), stopped


def reference_cut(text, stops):
    """The earliest-ending match wins; ties go to the one that starts first."""
    ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return (text[:min(ends)[1]], True) if ends else (text, False)


def test_stop_matcher_examples():
    assert run_matcher(("###",), ["ab#", "#", "#cd"]) == ("ab", True)
    assert run_matcher(("###",), ["ab#", "#x"]) == ("ab##x", False)
    assert run_matcher((), ["a", "b"]) == ("ab", False)
    m = StopMatcher(("END",))
    assert m.feed("xxE") == ("xx", False)  # "E" is held back
    assert m.feed("N") == ("", False)
    assert m.feed("D and more") == ("", True)
    assert m.feed("later") == ("", True) and m.flush() == ""


def test_stop_matcher_first_completed_match_wins():
    assert run_matcher(("abcd", "bc"), ["abcd"]) == ("a", True)
    assert run_matcher(("abcd", "bc"), ["ab", "c", "d"]) == ("a", True)
    with pytest.raises(ValueError):
        StopMatcher(("",))


texts = st.text(alphabet="abc\n", max_size=40)
stop_sets = st.lists(st.text(alphabet="abc\n", min_size=1, max_size=4), max_size=4)


@settings(max_examples=300, deadline=None)
@given(text=texts, stops=stop_sets, data=st.data())
def test_stop_matcher_any_split_matches_whole(text, stops, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    deltas = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    whole = run_matcher(tuple(stops), [text])
    assert run_matcher(tuple(stops), deltas) == whole == reference_cut(text, stops)
    assert not any(s in whole[0] for s in stops)


def test_n_answers_sample_with_consecutive_seeds():
    req = parse_chat(chat(n=3, seed=5), LIMITS)
    assert req.n == 3
    assert [req.sampling((2,), 99, i).seed for i in range(3)] == [5, 6, 7]
    assert parse_chat(chat(), LIMITS).sampling((2,), 99).seed == 99  # its own seed
    top = parse_chat(chat(seed=2**64 - 1), LIMITS).sampling((2,), 0, 1).seed
    assert top == -(2**63)  # wraps within what the sampler takes


def test_logprobs_fields_reach_the_engine():
    assert parse_chat(chat(), LIMITS).logprobs is None
    assert parse_chat(chat(logprobs=True), LIMITS).logprobs == 0
    req = parse_chat(chat(logprobs=True, top_logprobs=5), LIMITS)
    assert req.sampling((2,), 1).logprobs == 5
    assert parse_completion(comp(logprobs=3), LIMITS).logprobs == 3
    assert parse_completion(comp(logprobs=0), LIMITS).logprobs == 0
    assert parse_completion(comp(), LIMITS).logprobs is None
