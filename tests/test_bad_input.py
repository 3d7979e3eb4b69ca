"""Bad input at every edge that takes data from outside, without a server: the config tree,
the serve settings, namespace names, backend options, the msgpack records and the bodies of
the OpenAI and admin APIs.

The rule each test holds: bad input raises the edge's own clear error (`ConfigError`,
`MessageError`, `ApiError` with a 4xx) and nothing else escapes: no TypeError, KeyError,
OverflowError or RecursionError from deep inside, which a server would turn into a 500.
(`ConfigError` and `MessageError` are ValueErrors, so the tests catch `KvtierError` and let
any other ValueError fail them.)
"""
from __future__ import annotations

import dataclasses
import json
import os

import msgpack
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from kvtier.backends.file_root import FileRoot, object_path
from kvtier.config import HiCacheConfig, knob_names
from kvtier.errors import CacheUsageError, ConfigError, KvtierError
from kvtier.keys import KeyNamespace
from kvtier.messages import (DirectoryStats, LeaseGrant, LookupRequest, LookupResult,
                             MessageError, NamespaceInfo, NamespaceSpec, StoredReport)
from kvtier.policies import StorageBackendKind
from kvtier.frontend.admin import check_admin_key, parse_admin_body
from kvtier.frontend.openai_requests import ApiError, ApiLimits, parse_chat, parse_completion
from kvtier.frontend.settings import ServeSettings
from kvtier.storage_options import (FileOptions, MooncakeOptions, NixlOptions, SimulatedOptions,
                                    parse_storage_options)

FUZZ = settings(max_examples=150, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
LIMITS = ApiLimits(model_names=("smol",), max_prompt_tokens=100, max_new_tokens=64,
                   max_body_bytes=4096)

# ---- strategies -----------------------------------------------------------------------------

# Values that break naive checks: huge, negative, non-finite, wrong types, traversal strings.
NASTY = st.sampled_from([None, True, False, 0, -1, 1, 2**31, 2**63, 2**64, 2**70, -(2**70),
                         10**400, 1e300, -1e300, float("inf"), float("-inf"), float("nan"),
                         0.5, -0.0, "", " ", "0", "1e300", "true", "../../etc", "/abs",
                         "a/../b", "\x00", "x" * 10000, "\ud800", "файл", [], {}, [1], {"a": 1},
                         b"bytes"])
SCALARS = (st.none() | st.booleans() | st.integers() | st.integers(-(2**80), 2**80)
           | st.floats() | st.text(max_size=20) | NASTY)
JSONISH = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4)
                       | st.dictionaries(st.text(max_size=12), kids, max_size=4), max_leaves=12)
OPTION_KEYS = sorted({f.name for cls in (FileOptions, MooncakeOptions, NixlOptions,
                                         SimulatedOptions) for f in dataclasses.fields(cls)})
OPTIONS = st.dictionaries(st.sampled_from(OPTION_KEYS) | st.text(max_size=10), JSONISH,
                          max_size=4)
BACKENDS = st.sampled_from([k.value for k in StorageBackendKind])


def config_values(name: str) -> st.SearchStrategy:
    if name == "storage_options":
        return OPTIONS | JSONISH
    if name == "storage_backend":
        return BACKENDS | JSONISH
    return JSONISH


CONFIG_DICTS = st.dictionaries(st.sampled_from(knob_names()), st.just(None), max_size=6).flatmap(
    lambda keys: st.fixed_dictionaries({k: config_values(k) for k in keys})) | st.dictionaries(
    st.sampled_from(knob_names()) | st.text(max_size=12), JSONISH, max_size=4)


def only_clear_errors(fn, *args, error=KvtierError):
    """Run fn; the only exception allowed out is `error` (the edge's own, with a message)."""
    try:
        return fn(*args)
    except error as exc:
        assert str(exc), f"{type(exc).__name__} without a message"
        return None


# ---- the config tree ------------------------------------------------------------------------

@FUZZ
@given(CONFIG_DICTS)
@example({"page_size": 2**70})
@example({"hicache_ratio": 10**400})
@example({"storage_backend": "file", "storage_options": {"root_dir": "../../etc"}})
@example({"storage_backend": "file", "storage_options": 0})
@example({"storage_backend": ["file"]})
@example({"write_policy": {"a": 1}})
def test_config_from_dict_raises_only_config_error(d):
    config = only_clear_errors(HiCacheConfig.from_dict, d, error=ConfigError)
    if config is not None:  # whatever it accepted round-trips and normalizes
        assert HiCacheConfig.from_dict(config.to_dict()) == config
        config.normalize()


@pytest.mark.parametrize("d, needle", [
    ({"page_size": 2**70}, "--page-size"),
    ({"page_size": -64}, "--page-size"),
    ({"page_size": 64.0}, "integer"),
    ({"page_size": True}, "integer"),
    ({"hicache_ratio": 1e300}, "--hicache-ratio"),
    ({"hicache_ratio": 10**400}, "--hicache-ratio"),
    ({"hicache_size_gb": float("nan")}, "--hicache-size"),
    ({"hicache_ratio": "3"}, "number"),
    ({"write_policy": 3}, "--hicache-write-policy"),
    ({"write_policy": "write_sideways"}, "write_through"),
    ({"storage_backend": "floppy"}, "file"),
    ({"storage_backend": 7}, "--hicache-storage-backend"),
    ({"storage_options": {"root_dir": "/x"}}, "--hicache-storage-backend"),
    ({"storage_backend": "file", "storage_options": 0}, "mapping"),
    ({"storage_backend": "file", "storage_options": [["root_dir", "/x"]]}, "mapping"),
    ({"storage_backend": "file", "storage_options": {"root_dir": "../../etc"}}, "absolute"),
    ({"storage_backend": "file", "storage_options": {"bogus": 1}}, "bogus"),
    ({"pag_size": 64}, "page_size"),
    ({3: 64}, "strings"),
])
def test_config_errors_name_the_setting(d, needle):
    with pytest.raises(ConfigError, match=None) as info:
        HiCacheConfig.from_dict(d)
    assert needle in str(info.value)


@pytest.mark.parametrize("d", [None, [], "page_size=64", 3, [("page_size", 64)]])
def test_config_from_a_non_mapping(d):
    with pytest.raises(ConfigError, match="mapping"):
        HiCacheConfig.from_dict(d)


SERVE_KEYS = [f.name for f in dataclasses.fields(ServeSettings)] + ["l3", "hierarchical"]


@FUZZ
@given(st.dictionaries(st.sampled_from(SERVE_KEYS) | st.text(max_size=8), JSONISH, max_size=5))
@example({"l3_root": "relative/dir"})
@example({"l3_state_dir": "../state"})
@example({"instances": 2**70})
@example({"hicache_ratio": 10**400})
@example({"l3": ["file"]})
@example({"storage_backend": ["file"]})
@example({"l3": "file", "storage_backend": None})
@example({"tenant_salt": "../../etc"})
def test_serve_settings_raise_only_config_error(values):
    s = only_clear_errors(ServeSettings.from_mapping, values, error=ConfigError)
    if s is not None:
        assert ServeSettings.from_mapping(s.to_mapping()) == s
        if s.tenant_salt:  # what an instance will build its key namespace from
            KeyNamespace("m", s.tenant_salt)


@pytest.mark.parametrize("values, needle", [
    ({"l3_root": "data/l3"}, "absolute"),
    ({"l3_root": "/tmp/kv\x00"}, "l3_root"),
    ({"l3_state_dir": "../state"}, "absolute"),
    ({"tenant_salt": "../../etc"}, "tenant"),
    ({"tenant_salt": "a b"}, "tenant"),
    ({"instances": 0}, "instances"),
    ({"instances": "2"}, "instances"),
    ({"max_body_bytes": 2**70}, "max_body_bytes"),
    ({"request_timeout_s": float("inf")}, "request_timeout_s"),
    ({"hierarchical": "no"}, "hierarchical"),
    ({"l3": "floppy"}, "l3"),
    ({"l3": None}, "l3"),
    ({"storage_backend": "floppy"}, "storage_backend"),
    ({"storage_backend": ["file"]}, "storage_backend"),
    ({"enable_hierarchical_cache": "no"}, "enable_hierarchical_cache"),
    ({"admin_key": "short"}, "admin_key"),
    ({"admin_key": 12345678901234567890}, "admin_key"),
    ({"instancs": 2}, "instances"),
])
def test_serve_settings_errors_name_the_key(values, needle):
    with pytest.raises(ConfigError) as info:
        ServeSettings.from_mapping(values)
    assert needle in str(info.value)


# ---- namespace names ------------------------------------------------------------------------

BAD_NAMES = ["../../etc", "a/../b", "..", "/abs", "x" * 10000, "\x00", "a\x00b", "", " ",
             "a b", "model\n", "\nmodel", "mødel", "модель", "-lead", ".hidden", "a\\b",
             "a/" * 70, "\ud800"]


@pytest.mark.parametrize("name", BAD_NAMES)
def test_bad_model_names_are_refused(name):
    with pytest.raises(ConfigError, match="namespace model"):
        KeyNamespace(name)
    with pytest.raises(ConfigError, match="namespace model"):
        NamespaceSpec(name)


@pytest.mark.parametrize("salt", [n for n in BAD_NAMES if n])
def test_bad_salts_and_fingerprints_are_refused(salt):
    with pytest.raises(ConfigError, match="tenant salt"):
        KeyNamespace("m", tenant_salt=salt)
    with pytest.raises(ConfigError, match="layout fingerprint"):
        KeyNamespace("m", layout_fingerprint=salt)


@pytest.mark.parametrize("value", [None, 3, 3.0, b"model", ["m"], {"m": 1}, True])
def test_names_of_the_wrong_type_are_refused(value):
    with pytest.raises(ConfigError, match="must be a string"):
        KeyNamespace(value)
    with pytest.raises(ConfigError, match="must be a string"):
        KeyNamespace("m", tenant_salt=value)


@FUZZ
@given(st.text(max_size=140) | NASTY, st.text(max_size=20), st.text(max_size=20))
@example("a/./b", "", "")
@example("HuggingFaceTB/SmolLM2-135M-Instruct", "tenant-1", "0123abcd")
def test_an_accepted_namespace_name_is_one_safe_path_part(model, salt, fingerprint):
    ns = only_clear_errors(KeyNamespace, model, salt, fingerprint, error=ConfigError)
    if ns is None:
        return
    name = ns.name
    assert "/" not in name and ".." not in name and name[0].isalnum()
    assert all(ch.isascii() and ch.isprintable() and not ch.isspace() for ch in name)
    root = "/srv/l3"
    assert os.path.dirname(os.path.normpath(os.path.join(root, name))) == root


def test_namespace_spec_field_errors():
    with pytest.raises(ConfigError, match="backend"):
        NamespaceSpec("m", backend="floppy")
    with pytest.raises(ConfigError, match="kv_heads"):
        NamespaceSpec("m", kv_heads=2**70)
    with pytest.raises(ConfigError, match="max_pages"):
        NamespaceSpec("m", max_pages=-1)
    with pytest.raises(ConfigError, match="absolute"):
        NamespaceSpec("m", options={"root_dir": "../../etc"})
    with pytest.raises(ConfigError, match="mapping"):
        NamespaceSpec("m", options=0)
    with pytest.raises(MessageError, match="page_bytes"):
        NamespaceSpec("m", max_bytes=100)


# ---- backend options ------------------------------------------------------------------------

@FUZZ
@given(BACKENDS, OPTIONS | JSONISH)
@example("file", {"root_dir": "../../../etc"})
@example("file", {"root_dir": 5})
@example("file", {"max_size_bytes": 2**70})
@example("nixl", {"plugin": ["POSIX"]})
@example("mooncake", {"master_address": "http://evil/x"})
@example("simulated", {"bandwidth_gbps": 10**400})
def test_storage_options_raise_only_config_error(kind, options):
    parsed = only_clear_errors(parse_storage_options, kind, options, error=ConfigError)
    if parsed is None:
        return
    assert parse_storage_options(kind, parsed.to_dict()) == parsed
    root = getattr(parsed, "root_dir", None)
    if root is not None:  # file/nixl: a directory the operator chose, always absolute
        assert os.path.isabs(root) and "\x00" not in root


@pytest.mark.parametrize("kind, options, needle", [
    ("file", {"root_dir": "../../../etc"}, "absolute"),
    ("file", {"root_dir": "relative"}, "absolute"),
    ("file", {"root_dir": ""}, "empty"),
    ("file", {"root_dir": 5}, "string"),
    ("file", {"root_dir": "/tmp/kv\x00"}, "control"),
    ("file", {"root_dir": "/" + "x" * 5000}, "longer"),
    ("file", {"bogus": 1}, "bogus"),
    ("file", {"max_size_bytes": -1}, "max_size_bytes"),
    ("file", {"max_size_bytes": 2**70}, "max_size_bytes"),
    ("file", {"max_size_bytes": 1e300}, "integer"),
    ("file", {"fsync": "yes"}, "fsync"),
    ("nixl", {"root_dir": "a/../b"}, "absolute"),
    ("nixl", {"plugin": "GDS"}, "plugin"),
    ("mooncake", {"master_address": "host/../x"}, "master_address"),
    ("mooncake", {"global_segment_size_bytes": 2**70}, "global_segment_size_bytes"),
    ("mooncake", {"start_timeout_s": float("inf")}, "start_timeout_s"),
    ("mooncake", {"protocol": "carrier-pigeon"}, "protocol"),
    ("simulated", {"bandwidth_gbps": 0}, "bandwidth_gbps"),
    ("simulated", {"capacity_pages": -5}, "capacity_pages"),
    ("simulated", {"seed": 2**64}, "seed"),
])
def test_storage_option_errors_name_the_key(kind, options, needle):
    with pytest.raises(ConfigError) as info:
        parse_storage_options(kind, options)
    assert needle in str(info.value)


@pytest.mark.parametrize("options", [0, False, "", "root_dir=/x", [("root_dir", "/x")], 5])
def test_storage_options_of_the_wrong_type(options):
    with pytest.raises(ConfigError, match="mapping"):
        parse_storage_options("file", options)


def test_an_absolute_root_with_dots_is_the_operators_choice_and_objects_stay_inside(tmp_path):
    """`/a/b/../c` is a directory the operator named (normalized to `/a/c`): allowed. What must
    hold is that no object name leads out of it."""
    (tmp_path / "b").mkdir()
    opts = parse_storage_options("file", {"root_dir": f"{tmp_path}/b/../l3"})
    root = FileRoot(opts.root_dir)
    assert root.path == os.path.realpath(tmp_path / "l3")
    for name in ("../x", "ns/../../x", "/etc/passwd", "ns//x", "ns/./x", "ns/pool/\x00", ""):
        with pytest.raises(CacheUsageError, match="leave root_dir"):
            root.object_path(name)


@FUZZ
@given(st.lists(st.sampled_from(["..", ".", "", "a", "ns-1", "pool", "/", "\x00", "x..y"])
                | st.text(max_size=6), min_size=1, max_size=5).map("/".join))
def test_object_paths_never_leave_the_root(name):
    root = "/srv/l3"
    path = only_clear_errors(object_path, root, name, error=CacheUsageError)
    if path is not None:
        assert os.path.normpath(path).startswith(root + os.sep)


# ---- msgpack records ------------------------------------------------------------------------

SPEC = NamespaceSpec("m", "salt", "fp", options={"root_dir": "/tmp/kv"}, kv_heads=2)
RECORDS = [SPEC, NamespaceInfo(SPEC.namespace, SPEC, {"root_dir": "/tmp/kv"}, 3),
           StoredReport("ns", 1, 2, ("a" * 64,)), LookupRequest("ns", ("b" * 64,), 1.5),
           LeaseGrant("id", "ns", 2, 1.0), LookupResult("ns", 1, "id"),
           DirectoryStats(*(["ns"] + [0] * 14))]
RECORD_TYPES = [type(r) for r in RECORDS]
MSG_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=12) | st.binary(max_size=8),
    lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8)
                                                              | st.binary(max_size=4), kids,
                                                              max_size=3), max_leaves=8)


@FUZZ
@given(st.sampled_from(RECORD_TYPES), st.binary(max_size=64))
@example(LookupResult, b"\xc1")
@example(LookupResult, b"\x81\xa4type")
def test_random_bytes_are_a_message_error(cls, data):
    only_clear_errors(cls.from_msgpack, data, error=MessageError)


@st.composite
def mutated_record(draw):
    """A valid record's map with fields replaced, dropped or added (some with bytes keys)."""
    record = draw(st.sampled_from(RECORDS))
    data = record.to_map()
    for key in draw(st.lists(st.sampled_from(sorted(data)), max_size=3)):
        if draw(st.booleans()):
            data[key] = draw(MSG_VALUES)
        else:
            data.pop(key, None)
    for key in draw(st.lists(st.text(max_size=6) | st.binary(max_size=4), max_size=2)):
        data[key] = draw(MSG_VALUES)
    return type(record), msgpack.packb(data, use_bin_type=True)


@FUZZ
@given(mutated_record())
def test_mutated_records_are_a_message_error(case):
    cls, data = case
    decoded = only_clear_errors(cls.from_msgpack, data, error=MessageError)
    if decoded is not None:
        assert cls.from_msgpack(decoded.to_msgpack()) == decoded


def test_unknown_fields_with_bytes_keys_are_a_message_error():
    data = {**LookupResult("ns", 1).to_map(), b"extra": 1, "more": 2}
    with pytest.raises(MessageError, match="unknown field"):
        LookupResult.from_msgpack(msgpack.packb(data, use_bin_type=True))


@pytest.mark.parametrize("options", [{"root_dir": "../../../etc"}, {"root_dir": 5},
                                     {"bogus": 1}, {"max_size_bytes": 2**63}])
def test_a_spec_with_bad_options_is_a_message_error(options):
    data = {**SPEC.to_map(), "options": options}
    with pytest.raises(MessageError):
        NamespaceSpec.from_msgpack(msgpack.packb(data, use_bin_type=True))


def test_a_spec_with_a_traversal_model_is_a_message_error():
    data = {**SPEC.to_map(), "model": "../../etc"}
    with pytest.raises(MessageError, match="namespace model"):
        NamespaceSpec.from_msgpack(msgpack.packb(data, use_bin_type=True))


# ---- the OpenAI request bodies --------------------------------------------------------------

API_KEYS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
            "top_p", "seed", "stream", "stop", "stream_options", "n", "logprobs", "echo",
            "logit_bias", "tools", "response_format", "suffix", "top_k", "min_p",
            "repetition_penalty", "presence_penalty", "frequency_penalty", "ignore_eos",
            "stop_token_ids", "cache_salt"]
TEXT = st.text(max_size=12) | st.sampled_from(["\ud800", "a\udc80b", "\x00", "<|im_start|>"])
MESSAGE = st.fixed_dictionaries({}, optional={
    "role": st.sampled_from(["user", "system", "assistant", "tool", ""]) | JSONISH,
    "content": TEXT | st.lists(st.fixed_dictionaries({"type": st.just("text") | JSONISH},
                                                     optional={"text": TEXT | JSONISH}),
                               max_size=2) | JSONISH})
API_VALUES = {
    "model": st.just("smol") | JSONISH,
    "prompt": TEXT | st.lists(st.integers(-5, 2**40) | JSONISH, max_size=4)
    | st.lists(st.lists(st.integers(-2, 2**32)), max_size=2) | st.lists(TEXT, max_size=2)
    | JSONISH,
    "messages": st.lists(MESSAGE, max_size=3) | JSONISH,
    "stop": TEXT | st.lists(TEXT, max_size=5) | JSONISH,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JSONISH}) | JSONISH,
}
API_BODIES = st.dictionaries(st.sampled_from(API_KEYS), st.just(None), max_size=7).flatmap(
    lambda keys: st.fixed_dictionaries({k: API_VALUES.get(k, JSONISH) for k in keys}))


def _encodable(request) -> None:
    """What the tokenizer gets must be valid UTF-8 text (it raises TypeError otherwise)."""
    texts = list(request.stop) + [request.model]
    if hasattr(request, "messages"):
        texts += [m.content for m in request.messages]
    elif isinstance(request.prompt, str):
        texts.append(request.prompt)
    for text in texts:
        text.encode("utf-8")


def _api_fuzz(parse, body) -> None:
    raws = [body]  # as a decoded dict, and (when JSON can say it) through the JSON decoder
    try:
        raws.append(json.dumps(body).encode())
    except TypeError:  # bytes in the body: only the decoded form exists
        pass
    for raw in raws:
        try:
            request = parse(raw, LIMITS)
        except ApiError as exc:
            assert 400 <= exc.status < 500 and exc.message, exc
            json.dumps(exc.to_body()).encode("utf-8")  # the error body itself is sendable
        else:
            _encodable(request)
            request.sampling((2,), seed=0)  # what parsing let through, the engine takes


@FUZZ
@given(API_BODIES)
@example({"model": "smol", "prompt": "\ud800"})
@example({"model": "smol", "prompt": ["a\udc80"]})
@example({"model": "smol", "prompt": "hi", "stop": ["\ud800"]})
@example({"model": "\ud800", "prompt": "hi"})
def test_completion_bodies_raise_only_api_errors(body):
    _api_fuzz(parse_completion, body)


@FUZZ
@given(API_BODIES)
@example({"model": "smol", "messages": [{"role": "user", "content": "\ud800"}]})
@example({"model": "smol", "messages": [{"role": "user",
                                         "content": [{"type": "text", "text": "\udfff"}]}]})
@example({"model": "smol", "messages": [{"role": ["user"], "content": "x"}]})
def test_chat_bodies_raise_only_api_errors(body):
    _api_fuzz(parse_chat, body)


@pytest.mark.parametrize("parse", [parse_completion, parse_chat])
@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"{", b"[" * 100000, b'{"a": ' * 50000,
                                 b"NaN", b'{"model": Infinity}', b"1" * 5000,
                                 b'{"model": "smol", "max_tokens": 1' + b"0" * 5000 + b"}",
                                 b"\x00" * 10, b"x" * 5000])
def test_malformed_raw_bodies(parse, raw):
    with pytest.raises(ApiError) as info:
        parse(raw, LIMITS)
    assert 400 <= info.value.status < 500


@FUZZ
@given(st.binary(max_size=200))
def test_random_raw_bodies(raw):
    for parse in (parse_completion, parse_chat):
        try:
            parse(raw, LIMITS)
        except ApiError as exc:
            assert 400 <= exc.status < 500


def test_a_lone_surrogate_in_the_prompt_names_the_field():
    for body, param in [({"model": "smol", "prompt": "\ud800"}, "prompt"),
                        (b'{"model": "smol", "prompt": "a\\ud800b"}', "prompt"),
                        ({"model": "smol", "prompt": "x", "stop": "\udc80"}, "stop")]:
        with pytest.raises(ApiError) as info:
            parse_completion(body, LIMITS)
        assert info.value.status == 400 and info.value.param == param
    with pytest.raises(ApiError) as info:
        parse_chat(b'{"model": "smol", "messages": [{"role": "user", "content": "\\udfff"}]}',
                   LIMITS)
    assert info.value.param == "messages[0].content"


# Every numeric field of both endpoints, and values at the edges of what a float or an int
# can say: each is refused with a 400 naming the field, or accepted with values the sampler
# computes (a token, never an exception from NaN probabilities).
NUMERIC = {"max_tokens": "both", "max_completion_tokens": "chat", "temperature": "both",
           "top_p": "both", "top_k": "both", "min_p": "both", "repetition_penalty": "both",
           "presence_penalty": "both", "frequency_penalty": "both", "n": "both", "seed": "both",
           "logprobs": "both", "top_logprobs": "chat", "stop_token_ids": "both",
           "prompt": "completion"}
EXTREMES = [1e-40, -1e-40, 5e-324, 1e-7, 1e40, -1e40, 1.7976931348623157e308, -0.0, 0.0, 0,
            1, 2, 0.5, 2**31, 2**63, 2**64, -(2**63) - 1, 2**200, 10**400, float("nan"),
            float("inf"), float("-inf"), "NaN", "Infinity", "1e-40", "-0.0", "1", True, False,
            [], [1e-40], [[1]], {}, {"value": 1}]


def _extreme_bodies(endpoint: str):
    base = {"model": "smol", "max_tokens": 4}
    base.update({"prompt": "hi"} if endpoint == "completion"
                else {"messages": [{"role": "user", "content": "hi"}]})
    for field, where in NUMERIC.items():
        if where not in ("both", endpoint):
            continue
        for value in EXTREMES:
            for sent in (value, [value]) if field in ("stop_token_ids", "prompt") else (value,):
                body = {**base, field: sent}
                if field == "max_completion_tokens":
                    del body["max_tokens"]
                if field == "top_logprobs":
                    body["logprobs"] = True
                if field == "temperature" or field == "repetition_penalty":
                    yield field, {**body, "temperature": 1.0, field: sent}  # sampled
                yield field, body


def _computes(request) -> None:
    """What parsing let through, the engine's sampler takes and samples a token with."""
    import torch

    from kvtier.engine.sampling import Sampler

    logits = torch.linspace(-60.0, 60.0, 97)  # large logits, as a confident model gives
    params = request.sampling((2,), seed=0)
    sampler = Sampler(params, prompt=[96, 95, 1])  # the likeliest tokens, seen already
    for _ in range(3):
        assert 0 <= sampler(logits) < 97


@pytest.mark.parametrize("endpoint, parse", [("completion", parse_completion),
                                             ("chat", parse_chat)])
def test_extreme_numbers_in_every_numeric_field_are_refused_or_computable(endpoint, parse):
    seen = set()
    for field, body in _extreme_bodies(endpoint):
        seen.add(field)
        try:
            request = parse(body, LIMITS)
        except ApiError as exc:
            assert exc.status == 400 and (exc.param or "").startswith(field), (body, exc)
            continue
        _computes(request)
    assert seen == {f for f, w in NUMERIC.items() if w in ("both", endpoint)}


@pytest.mark.parametrize("field", [f for f, w in NUMERIC.items() if w != "chat"])
def test_json_constants_are_refused_naming_the_field(field):
    """NaN and Infinity are not JSON (Python's decoder takes them): a 400 that says where."""
    for constant in ("NaN", "Infinity", "-Infinity"):
        value = f"[{constant}]" if field in ("stop_token_ids", "prompt") else constant
        raw = '{"model": "smol", "prompt": "hi", "%s": %s}' % (field, value)
        with pytest.raises(ApiError) as info:
            parse_completion(raw.encode(), LIMITS)
        assert info.value.status == 400 and info.value.param.startswith(field), info.value
        assert constant in info.value.message and "finite number" in info.value.message


def test_json_constants_deep_in_a_body_name_their_place():
    raw = b'{"model": "smol", "messages": [{"role": "user", "content": [NaN]}]}'
    with pytest.raises(ApiError) as info:
        parse_chat(raw, LIMITS)
    assert info.value.param == "messages[0].content[0]"


def test_a_tiny_temperature_is_raised_to_the_least_one_sampled():
    """vLLM's rule: 0 < temperature < 0.01 samples at 0.01 (as good as greedy)."""
    from kvtier.frontend.openai_requests import MIN_TEMPERATURE

    for t in (1e-40, 5e-324, 1e-5, 0.0099):
        assert parse_completion(comp_body(temperature=t), LIMITS).temperature == MIN_TEMPERATURE
    assert parse_completion(comp_body(temperature=0.02), LIMITS).temperature == 0.02
    greedy = parse_completion(comp_body(temperature=-0.0), LIMITS).temperature
    assert greedy == 0.0 and str(greedy) == "0.0"  # -0.0 is 0: greedy


def test_a_repetition_penalty_the_sampler_cannot_apply_is_refused():
    from kvtier.frontend.openai_requests import MIN_REPETITION_PENALTY

    for p in (1e-39, 1e-40, 5e-324, MIN_REPETITION_PENALTY / 2):
        with pytest.raises(ApiError) as info:
            parse_completion(comp_body(repetition_penalty=p, temperature=1.0), LIMITS)
        assert info.value.param == "repetition_penalty"
        assert str(MIN_REPETITION_PENALTY) in info.value.message
    req = parse_completion(comp_body(repetition_penalty=MIN_REPETITION_PENALTY), LIMITS)
    assert req.repetition_penalty == MIN_REPETITION_PENALTY


def comp_body(**fields) -> dict:
    return {"model": "smol", "prompt": "hi", **fields}


# ---- the admin API --------------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=200) | JSONISH.map(lambda v: json.dumps(v, default=repr).encode())
       | st.fixed_dictionaries({"backend": BACKENDS | JSONISH}, optional={"options": OPTIONS})
       .map(lambda v: json.dumps(v, default=repr).encode()))
@example(b"[" * 5000)
@example(b'{"backend": "file", "options": {"root_dir": "' + b"[" * 10 + b'"}}')
@example(b'{"backend": 5}')
@example(b'{"backend": "file", "options": [1]}')
def test_admin_bodies_raise_only_api_errors(raw):
    try:
        body = parse_admin_body(raw)
    except ApiError as exc:
        assert 400 <= exc.status < 500 and exc.message
    else:
        assert isinstance(body, dict)
        assert isinstance(body.get("backend", ""), str)
        assert body.get("options") is None or isinstance(body["options"], dict)


def test_deeply_nested_admin_body_is_a_400():
    with pytest.raises(ApiError) as info:
        parse_admin_body(b"[" * 60000)
    assert info.value.status == 400


@FUZZ
@given(st.text(max_size=60))
@example("Bearer ")
@example("bearer  test-admin-key-0123456789  ")
@example("Basic dGVzdA==")
@example("Bearer test-admin-key-0123456789\x00")
@example("Bearer \ud800")
def test_admin_key_check_is_401_or_pass(header):
    key = "test-admin-key-0123456789"
    try:
        check_admin_key(header, key)
    except ApiError as exc:
        assert exc.status == 401
    else:
        scheme, _, given_key = header.partition(" ")
        assert scheme.lower() == "bearer" and given_key.strip() == key


@pytest.mark.parametrize("body, param, needle", [
    ({"backend": "floppy"}, "backend", "floppy"),
    ({"backend": "file", "options": {"root_dir": "../../../etc"}}, "options", "absolute"),
    ({"backend": "file", "options": {"root_dir": 5}}, "options", "root_dir"),
    ({"backend": "file", "options": {"bogus": 1}}, "options", "bogus"),
    ({"backend": "nixl", "options": {"max_size_bytes": 2**70}}, "options", "max_size_bytes"),
])
def test_admin_attach_options_are_checked_at_the_edge(body, param, needle):
    """The ingress refuses bad backend options itself, before any instance is asked."""
    with pytest.raises(ApiError) as info:
        parse_admin_body(json.dumps(body).encode())
    assert (info.value.status, info.value.param) == (400, param)
    assert needle in info.value.message


def test_good_attach_bodies_pass_the_edge():
    assert parse_admin_body(b'{"backend": "file"}') == {"backend": "file"}
    body = {"backend": "FILE", "options": {"root_dir": "/srv/l3", "max_size_bytes": 10**9}}
    assert parse_admin_body(json.dumps(body).encode()) == body
    assert parse_admin_body(b"") == {} and parse_admin_body(b" \n") == {}
