"""Bad input over real HTTP: one instance of the tiny model behind the serve graph, with a file
L3, fed malformed and random bodies, invalid token ids, empty and too long prompts, bad admin
attach requests and wrong admin keys.

What must hold for every request: an answer within the timeout, 200 or a 4xx with an OpenAI
error body (never a 5xx), and nothing changed by a refused request: /health stays 200 and the
L3 shown by /admin/storage stays the one the server started with. Every numeric field also
gets the extremes (1e-40, 1e40, -0.0, NaN and Infinity as JSON constants and as strings,
integers past 64 bits): each is served or refused with a 4xx naming that field.
"""
from __future__ import annotations

import json

import pytest
import requests
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from shared_serve import BASE, served

from kvtier.frontend.settings import ServeSettings

KEY = "fuzz-admin-key-0123456789"
# Every cache knob off its default (SGLang's names): the running ranks must report them.
HICACHE = {"write_policy": "write_through_selective", "io_backend": "direct",
           "mem_layout": "page_head", "host_mode": "cache",
           "prefetch_policy": "best_effort", "prefetch_threshold_tokens": 64,
           "prefetch_timeout_base_s": 1.5, "prefetch_timeout_per_ki_token_s": 0.2,
           "prefetch_timeout_max_s": 20.0, "load_back_threshold_tokens": 32,
           "prefetch_capacity_ratio": 0.4, "storage_batch_pages": 8}
SETTINGS = ServeSettings(model="tiny", instances=1, page_size=16, chunk_tokens=64,
                         device_pages=96, max_new_tokens=32, dtype="fp32", admin_key=KEY,
                         storage_backend="file", hicache_ratio=3.0, hicache=HICACHE)
MODEL = SETTINGS.served_model_name
MAX_PROMPT = SETTINGS.max_prompt_tokens
ADMIN = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 60  # a hang is a failure, not a stuck test run
VOCAB = 49152  # SmolLM2's vocabulary, which the tiny model uses
HTTP_FUZZ = settings(max_examples=40, deadline=None, database=None,
                     suppress_health_check=list(HealthCheck))

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def app():
    with served(SETTINGS):
        yield


def post(path: str, body, headers: dict | None = None) -> requests.Response:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return requests.post(f"{BASE}{path}", data=data, timeout=TIMEOUT_S,
                         headers={"Content-Type": "application/json", **(headers or {})})


def assert_answered(r: requests.Response) -> None:
    """200 with a whole answer, or a 4xx with OpenAI's error body; never a 5xx."""
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:1000])
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["message"], error
        assert error["type"] == ("not_found_error" if r.status_code == 404
                                 else "invalid_request_error"), error
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]") and "server_error" not in r.text, r.text
    else:
        assert r.json()["choices"], r.text


def refused(path: str, body, status: int = 400, headers: dict | None = None) -> dict:
    r = post(path, body, headers)
    assert r.status_code == status, (r.status_code, r.text[:1000])
    return r.json()["error"]


def healthy() -> None:
    r = requests.get(f"{BASE}/health", timeout=TIMEOUT_S)
    assert r.status_code == 200 and r.json()["broken"] == {}, r.text


def storage() -> list:
    r = requests.get(f"{BASE}/admin/storage", headers=ADMIN, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    return [i["l3"] for i in r.json()["instances"]]


# ---- random bodies --------------------------------------------------------------------------

LEAF = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
        | st.text(max_size=16) | st.sampled_from([MODEL, "\ud800", "", "x" * 300, 1e308, -1]))
JSONISH = st.recursive(LEAF, lambda kids: st.lists(kids, max_size=3)
                       | st.dictionaries(st.text(max_size=8), kids, max_size=3), max_leaves=8)
TOKENS = st.lists(st.integers(-3, VOCAB + 3) | st.integers(-(2**41), 2**41) | st.floats()
                  | st.text(max_size=2) | st.booleans(), max_size=5)
MESSAGES = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | JSONISH},
    optional={"content": st.text(max_size=40) | JSONISH}), max_size=3) | JSONISH
# Tiny, huge and signed-zero numbers, which naive range checks let through to the sampler
NUMBERS = (st.floats(allow_nan=False) | st.integers(-(2**70), 2**70)
           | st.sampled_from([1e-40, -1e-40, 5e-324, 1e-39, -0.0, 1e40, 2**64]) | JSONISH)
FIELDS = {"prompt": st.text(max_size=40) | TOKENS | JSONISH,
          "messages": MESSAGES, "max_tokens": st.integers(-2, 40) | JSONISH,
          "temperature": st.floats(-1, 3) | JSONISH, "top_p": st.floats(-0.5, 1.5) | JSONISH,
          "seed": st.integers(-(2**65), 2**65) | JSONISH, "stream": st.booleans() | JSONISH,
          "stop": st.text(max_size=4) | st.lists(st.text(max_size=4), max_size=5) | JSONISH,
          "stream_options": JSONISH, "n": JSONISH, "logprobs": JSONISH, "tools": JSONISH,
          **{name: NUMBERS for name in ("repetition_penalty", "top_k", "min_p",
                                        "presence_penalty", "frequency_penalty",
                                        "top_logprobs", "max_completion_tokens")},
          "stop_token_ids": st.lists(NUMBERS, max_size=3) | NUMBERS}
BODIES = (st.fixed_dictionaries({"model": st.just(MODEL) | JSONISH}, optional=FIELDS)
          .map(lambda d: json.dumps(d).encode())
          | JSONISH.map(lambda v: json.dumps(v).encode())
          | st.binary(max_size=64))


@HTTP_FUZZ
@given(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), BODIES)
@example("/v1/completions", b"")
@example("/v1/completions", b"\xff\xfe{")
@example("/v1/chat/completions", b"[" * 50000)
@example("/v1/completions", b'{"model": "%s", "prompt": "\\ud800"}' % MODEL.encode())
@example("/v1/chat/completions",
         b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udc80"}]}'
         % MODEL.encode())
@example("/v1/completions", b'{"model": "%s", "prompt": "x", "stop": ["\\ud800"]}'
         % MODEL.encode())
@example("/v1/completions", b'{"model": "%s", "prompt": "x", "temperature": NaN}'
         % MODEL.encode())
@example("/v1/completions", b'{"model": "%s", "prompt": "x", "max_tokens": 1e999}'
         % MODEL.encode())
def test_random_bodies_get_a_200_or_a_4xx(app, path, body):
    assert_answered(post(path, body))


# ---- extreme numbers in every numeric field -------------------------------------------------

# field -> the endpoints that take it
NUMERIC = {"max_tokens": "both", "max_completion_tokens": "chat", "temperature": "both",
           "top_p": "both", "top_k": "both", "min_p": "both", "repetition_penalty": "both",
           "presence_penalty": "both", "frequency_penalty": "both", "n": "both",
           "seed": "both", "logprobs": "both", "top_logprobs": "chat",
           "stop_token_ids": "both", "prompt": "completions"}
# As JSON text: NaN and Infinity are constants Python's decoder takes, not JSON. (More
# values, without HTTP: tests/test_bad_input.py.)
EXTREMES = ["1e-40", "1e40", "-0.0", str(2**64), "NaN", "-Infinity", '"NaN"', "true"]


def extreme_bodies(path: str):
    endpoint = "chat" if "chat" in path else "completions"
    base = {"model": MODEL, "max_tokens": 2, "temperature": 0.7}  # sampled: the hard path
    base.update({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat"
                else {"prompt": "hi"})
    for field, where in NUMERIC.items():
        if where not in ("both", endpoint):
            continue
        body = {k: v for k, v in base.items() if k != field}
        if field == "max_completion_tokens":
            del body["max_tokens"]
        if field == "top_logprobs":
            body["logprobs"] = True
        for value in EXTREMES:
            sent = f"[{value}]" if field in ("stop_token_ids", "prompt") else value
            yield field, json.dumps(body)[:-1].encode() + b', "%s": %s}' % (
                field.encode(), sent.encode())


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_extreme_numbers_in_every_field_are_served_or_refused_naming_it(app, path):
    served = 0
    for field, body in extreme_bodies(path):
        r = post(path, body)
        assert_answered(r)
        if r.status_code == 200:
            served += 1
        else:
            error = r.json()["error"]
            assert (error["param"] or "").startswith(field), (body, error)
    assert served  # tiny sampling values are served (clamped or as they are), not refused
    healthy()  # and a plain request is served as before
    r = post("/v1/completions", {"model": MODEL, "prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_every_cache_knob_reaches_the_running_ranks(app):
    r = requests.get(f"{BASE}/admin/config", headers=ADMIN, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    (running,) = r.json()["instances"]
    assert {k: running["hicache"][k] for k in HICACHE} == HICACHE
    assert (running["hicache"]["page_size"], running["hicache"]["hicache_ratio"]) == (16, 3.0)
    assert running["l3"] == "file"  # attached at start, through the namespace actor
    assert (running["dtype"], running["chunk_tokens"], running["device_pages"]) == \
        ("fp32", 64, 96)
    assert running["host_pages"] == 3 * 96
    assert requests.get(f"{BASE}/admin/config", timeout=TIMEOUT_S).status_code == 401


def test_the_server_is_healthy_after_the_fuzz(app):
    healthy()
    r = post("/v1/completions", {"model": MODEL, "prompt": "still here", "max_tokens": 2})
    assert r.status_code == 200 and 1 <= r.json()["usage"]["completion_tokens"] <= 2, r.text


# ---- prompts --------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [[-1], [VOCAB], [VOCAB + 1000], [2**31], [2**40], [1.5],
                                    [1.0], ["a", 1], [1, "2"], [True], [None], [[1, -1]],
                                    [[1, 2**40]], [1, [2]]])
def test_invalid_token_ids_are_a_400(app, prompt):
    error = refused("/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert error["param"].startswith("prompt"), error


def test_the_last_token_id_of_the_vocabulary_is_fine(app):
    r = post("/v1/completions", {"model": MODEL, "prompt": [0, VOCAB - 1], "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": ""}),
    ("/v1/completions", {"model": MODEL, "prompt": []}),
    ("/v1/completions", {"model": MODEL, "prompt": [""]}),
    ("/v1/completions", {"model": MODEL, "prompt": [[]]}),
    ("/v1/completions", {"model": MODEL}),
    ("/v1/completions", {"model": MODEL, "prompt": None}),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}),
    ("/v1/chat/completions", {"model": MODEL}),
])
def test_empty_prompts_are_a_400(app, path, body):
    error = refused(path, body)
    assert error["param"] in ("prompt", "messages"), error


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": MODEL, "prompt": "x " * (MAX_PROMPT + 100)}),
    ("/v1/completions", {"model": MODEL, "prompt": [0] * (MAX_PROMPT + 1)}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "word " * (MAX_PROMPT + 100)}]}),
])
def test_too_long_prompts_are_a_400(app, path, body):
    error = refused(path, body)
    assert error["code"] == "context_length_exceeded" and str(MAX_PROMPT) in error["message"]


def test_a_prompt_of_exactly_the_limit_is_served(app):
    r = post("/v1/completions", {"model": MODEL, "prompt": [1] * MAX_PROMPT, "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("body, status", [
    (b"", 400), (b"null", 400), (b"\x00\x01", 400), (b'{"model": ', 400),
    (b"{" + b" " * (2 << 20) + b"}", 413),
])
def test_malformed_bodies(app, body, status):
    refused("/v1/chat/completions", body, status)


# ---- the admin API --------------------------------------------------------------------------

BAD_ATTACHES = [
    ({"backend": "floppy"}, "floppy"),
    ({"backend": "hf3fs"}, "hf3fs"),
    ({"backend": 5}, "backend"),
    ({"backend": None}, "backend"),
    ({"options": {"root_dir": "/tmp/x"}}, "backend"),
    ({"backend": "file", "options": {"root_dir": "../../../etc"}}, "absolute"),
    ({"backend": "file", "options": {"root_dir": "a/../../b"}}, "absolute"),
    ({"backend": "file", "options": {"root_dir": 5}}, "string"),
    ({"backend": "file", "options": {"root_dir": "/tmp/kv\u0000"}}, "control"),
    ({"backend": "file", "options": {"root_dir": "/" + "x" * 5000}}, "longer"),
    ({"backend": "file", "options": {"bogus": 1}}, "bogus"),
    ({"backend": "file", "options": {"max_size_bytes": 2**70}}, "max_size_bytes"),
    ({"backend": "file", "options": {"max_size_bytes": -1}}, "max_size_bytes"),
    ({"backend": "file", "options": {"fsync": "yes"}}, "fsync"),
    ({"backend": "file", "options": [1, 2]}, "options"),
    ({"backend": "file", "options": "root_dir=/etc"}, "options"),
    ({"backend": "nixl", "options": {"root_dir": "../etc"}}, "absolute"),
    ({"backend": "mooncake", "options": {"master_address": "evil/../x"}}, "master_address"),
    ({"backend": "simulated", "options": {"bandwidth_gbps": 1e308}}, "bandwidth_gbps"),
]


def attach(body, headers=ADMIN) -> requests.Response:
    return post("/admin/storage/attach", body, headers)


def test_bad_attaches_are_refused_and_change_nothing(app):
    original = storage()
    assert [l3["backend"] for l3 in original] == ["file"]
    for body, needle in BAD_ATTACHES:
        r = attach(body)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        assert needle in r.json()["error"]["message"], (body, r.text)
        assert storage() == original, body
    for raw in (b"{", b"[]", b'"file"', b"[" * 50000, b"\xff", b"{" + b" " * (70 << 10) + b"}"):
        r = attach(raw)
        assert 400 <= r.status_code < 500, (raw[:20], r.status_code, r.text)
    assert storage() == original
    healthy()


def test_bad_attaches_while_detached_attach_nothing(app):
    """With no L3, a refused attach must not leave one half attached; a good one still works."""
    original = storage()
    r = post("/admin/storage/detach", b"", ADMIN)
    assert r.status_code == 200, r.text
    try:
        assert storage() == [None]
        for body, needle in BAD_ATTACHES:
            r = attach(body)
            assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
            assert storage() == [None], body
        r = post("/v1/completions", {"model": MODEL, "prompt": "no L3 here", "max_tokens": 2})
        assert r.status_code == 200, r.text
    finally:
        r = attach({"backend": "file", "options": original[0]["options"]})
    assert r.status_code == 200, r.text
    assert storage() == original


@HTTP_FUZZ
@given(st.fixed_dictionaries({"backend": st.sampled_from(["file", "nixl", "mooncake",
                                                          "simulated", "floppy"]) | JSONISH},
                             optional={"options": st.dictionaries(
                                 st.sampled_from(["root_dir", "max_size_bytes", "fsync",
                                                  "plugin", "master_address", "bogus"])
                                 | st.text(max_size=6), JSONISH, max_size=3) | JSONISH}))
def test_random_attaches_while_attached_are_refused(app, body):
    """L3 is attached, so no attach can succeed: each is a 4xx and the L3 stays."""
    r = attach(body)
    assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
    assert r.json()["error"]["message"]
    assert [l3["backend"] for l3 in storage()] == ["file"]


WRONG_KEYS = [{}, {"Authorization": ""}, {"Authorization": KEY},
              {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"},
              {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": "Bearer "},
              {"Authorization": f"Bearer{KEY}"}, {"X-Admin-Key": KEY},
              {"Authorization": f"Bearer {KEY.upper()}"},
              {"Authorization": "Bearer \u00e9\u00e9\u00e9".encode("utf-8").decode("latin-1")}]


@pytest.mark.parametrize("headers", WRONG_KEYS)
def test_wrong_admin_keys_are_a_401_and_change_nothing(app, headers):
    original = storage()
    for method, path, body in [("post", "/admin/storage/detach", b""),
                               ("post", "/admin/storage/attach", {"backend": "file"}),
                               ("post", "/admin/flush", b""), ("post", "/admin/purge", b""),
                               ("get", "/admin/storage", None), ("get", "/admin/router", None)]:
        if method == "get":
            r = requests.get(f"{BASE}{path}", headers=headers, timeout=TIMEOUT_S)
        else:
            r = post(path, body, headers)
        assert r.status_code == 401, (path, r.status_code, r.text)
        assert r.json()["error"]["type"] == "authentication_error"
        assert r.headers.get("www-authenticate") == "Bearer"
    assert storage() == original
