"""API keys mapped to tenants, the keys file, and the salt a request's prefixes are cached under."""
from __future__ import annotations

import json

import pytest

from kvtier.errors import ConfigError
from kvtier.frontend.openai_requests import ApiError, ApiLimits, parse_chat, parse_completion
from kvtier.frontend.settings import ServeSettings
from kvtier.frontend.tenants import ApiKeys, load_api_keys, request_salt

LIMITS = ApiLimits(model_names=("m",), max_prompt_tokens=100, max_new_tokens=10)
KEYS = {"sk-acme-0001": "acme", "sk-acme-0002": "acme", "sk-globex-01": "globex"}


def test_keys_name_tenants_and_anything_else_is_a_401():
    keys = ApiKeys(KEYS, api_key="sk-plain")
    assert keys.tenant("Bearer sk-acme-0001") == keys.tenant("bearer sk-acme-0002") == "acme"
    assert keys.tenant("Bearer sk-globex-01") == "globex"
    assert keys.tenant("Bearer sk-plain") == ""  # --api-key: the default tenant
    for header in ("", "Bearer", "Bearer sk-acme-000", "sk-acme-0001", "Basic sk-acme-0001",
                   "Bearer sk-acme-0001x"):
        with pytest.raises(ApiError) as err:
            keys.tenant(header)
        assert err.value.status == 401


def test_salts_separate_tenants_and_cache_salts_and_nothing_else():
    salts = {request_salt(t, c) for t in ("", "acme", "globex") for c in ("", "a", "b")}
    assert len(salts) == 9 and request_salt("", "") == ""
    assert request_salt("ab", "c") != request_salt("a", "bc")  # length-prefixed parts
    assert request_salt("acme", "a") == request_salt("acme", "a")


def test_the_keys_file_is_read_into_the_settings(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(KEYS))
    assert load_api_keys(str(path)) == KEYS
    s = ServeSettings.from_mapping({"model": "tiny", "api_keys_file": str(path)})
    assert s.api_keys == KEYS and "api_keys_file" not in s.to_mapping()
    assert ServeSettings.from_mapping(s.to_mapping()).api_keys == KEYS  # crosses to replicas


@pytest.mark.parametrize("content, words", [
    ("{", "not JSON"), ("[]", "JSON object"), ('{"short": "a"}', "API key must be"),
    ('{"sk-0123456789": "no spaces"}', "tenant of key"), ('{"sk-0123456789": 3}', "tenant"),
])
def test_a_bad_keys_file_names_what_is_wrong(tmp_path, content, words):
    path = tmp_path / "keys.json"
    path.write_text(content)
    with pytest.raises(ConfigError, match=words):
        load_api_keys(str(path))
    with pytest.raises(ConfigError, match="cannot read"):
        load_api_keys(str(tmp_path / "missing.json"))


def test_cache_salt_is_parsed_or_refused_by_name():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat({**body, "cache_salt": "s1"}, LIMITS).cache_salt == "s1"
    assert parse_chat(body, LIMITS).cache_salt == ""
    assert parse_completion({"model": "m", "prompt": "x", "cache_salt": "s"}, LIMITS).cache_salt == "s"
    for bad in ("", 3, "x" * 257, ["s"], "\ud800"):
        with pytest.raises(ApiError) as err:
            parse_chat({**body, "cache_salt": bad}, LIMITS)
        assert err.value.status == 400 and err.value.param == "cache_salt"
