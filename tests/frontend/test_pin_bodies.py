"""The /admin/pin body rules (Ray-free): every bad body is a 4xx naming the field; a pin's id
depends on its salt and tokens only; the listing merges the tiers; the pin metrics."""
from __future__ import annotations

import json

import pytest

from kvtier.errors import ConfigError
from kvtier.frontend.metrics import ServeMetrics
from kvtier.frontend.openai_requests import ApiError
from kvtier.frontend.pins import merge_pins, parse_pin_body, pin_id
from kvtier.frontend.settings import ServeSettings
from kvtier.tiers.cache_pins import PinListing
from kvtier.tiers.page_pins import MAX_PIN_TTL_S, L3PinListing

GOOD = {"tokens": [1, 2, 3], "ttl_s": 60}


def raw(body) -> bytes:
    return body if isinstance(body, bytes) else json.dumps(body).encode()


@pytest.mark.parametrize("body,status,needle", [
    ({"ttl_s": 60}, 400, "either tokens"),  # neither tokens nor messages
    ({**GOOD, "messages": [{"role": "user", "content": "hi"}]}, 400, "exactly one"),
    ({"tokens": [1, "2"], "ttl_s": 60}, 400, "tokens[1]"),
    ({"tokens": [1, 2.5], "ttl_s": 60}, 400, "tokens[1]"),
    ({"tokens": [1, True], "ttl_s": 60}, 400, "tokens[1]"),
    ({"tokens": [-1], "ttl_s": 60}, 400, "tokens[0]"),
    ({"tokens": [2 ** 32], "ttl_s": 60}, 400, "tokens[0]"),
    ({"tokens": [], "ttl_s": 60}, 400, "tokens"),
    ({"tokens": "1 2 3", "ttl_s": 60}, 400, "tokens"),
    ({"messages": [], "ttl_s": 60}, 400, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}], "ttl_s": 60}, 400, "messages[0].role"),
    ({"messages": "hi", "ttl_s": 60}, 400, "messages"),
    ({"tokens": [1]}, 400, "ttl_s"),  # required
    ({**GOOD, "ttl_s": 0}, 400, "ttl_s"),
    ({**GOOD, "ttl_s": -5}, 400, "ttl_s"),
    ({**GOOD, "ttl_s": MAX_PIN_TTL_S + 1}, 400, "86400"),
    ({**GOOD, "ttl_s": "60"}, 400, "ttl_s"),
    ({**GOOD, "ttl_s": True}, 400, "ttl_s"),
    ({**GOOD, "ttl_s": None}, 400, "ttl_s"),
    ({**GOOD, "tenant": 7}, 400, "tenant"),
    ({**GOOD, "tenant": "no spaces"}, 400, "tenant"),
    ({**GOOD, "cache_salt": ["x"]}, 400, "cache_salt"),
    ({**GOOD, "cache_salt": "x" * 257}, 400, "cache_salt"),
    ({**GOOD, "ttl": 60}, 400, "unknown field"),
    ({**GOOD, "id": "0123456789abcdef"}, 400, "unknown field"),  # id only for DELETE
    ([1, 2], 400, "object"),
    (b"{nope", 400, "JSON"),
    (b"", 400, "either tokens"),
    (b"{" + b" " * (65 << 10) + b"}", 413, "65536 bytes"),
])
def test_bad_pin_bodies_are_a_4xx_naming_the_field(body, status, needle):
    with pytest.raises(ApiError) as err:
        parse_pin_body(raw(body))
    assert err.value.status == status and needle in err.value.message


@pytest.mark.parametrize("body,needle", [
    ({"id": "xyz"}, "16 hex"),
    ({"id": "0123456789abcdef", "ttl_s": 5}, "alone"),
    ({"id": 5}, "16 hex"),
])
def test_bad_unpin_bodies(body, needle):
    with pytest.raises(ApiError, match=needle):
        parse_pin_body(raw(body), delete=True)


def test_a_pin_body_may_be_as_long_as_a_request_body():
    long = raw({"tokens": [12345] * 20_000, "ttl_s": 5})  # 140 kB: over the admin default
    assert len(parse_pin_body(long, max_bytes=1 << 20).tokens) == 20_000
    with pytest.raises(ApiError, match="at most 1024 bytes"):
        parse_pin_body(long, max_bytes=1024)


def test_good_bodies():
    body = parse_pin_body(raw({**GOOD, "tenant": "acme", "cache_salt": "s1"}))
    assert (body.tokens, body.tenant, body.cache_salt, body.ttl_s) == ((1, 2, 3), "acme", "s1",
                                                                        60.0)
    chat = parse_pin_body(raw({"messages": [{"role": "system", "content": "Be brief."}],
                               "ttl_s": 0.5}))
    assert chat.messages[0].content == "Be brief." and chat.tokens is None
    assert parse_pin_body(raw({"tokens": [1]}), delete=True).ttl_s is None  # no TTL to unpin
    assert parse_pin_body(raw({"id": "0123456789abcdef"}), delete=True).pin_id


def test_a_pin_id_names_the_salt_and_the_tokens():
    a = pin_id("", [1, 2, 3, 4])
    assert a == pin_id("", (1, 2, 3, 4)) and len(a) == 16
    assert a != pin_id("acme", [1, 2, 3, 4]) and a != pin_id("", [1, 2, 3, 5])


def test_the_listing_merges_instances_and_l3():
    pin = PinListing("p", "", 3, 5.0, device_pages=1, host_pages=3)
    merged = merge_pins({"instance-0": [pin], "instance-1": []},
                        [L3PinListing("p", "", 3, 9.0), L3PinListing("q", "acme", 2, 1.0)], 16,
                        now_s=1000.0)
    assert [m["id"] for m in merged] == ["p", "q"]
    assert merged[0]["tokens"] == 48 and merged[0]["expires_in_s"] == 9.0
    assert merged[0]["expires_at"] == 1009.0
    assert merged[0]["instances"] == {"instance-0": {"device_pages": 1, "host_pages": 3,
                                                     "expires_in_s": 5.0}}
    assert merged[0]["l3_pages"] == 3 and merged[1]["instances"] == {}


def test_pin_metrics_and_the_validated_share():
    metrics = ServeMetrics()
    metrics.update_pins("instance-0", {"pins": 2, "device_pages": 1, "host_pages": 5})
    metrics.update_namespace("ns", {"pins": 2, "pinned_pages": 5})
    text = metrics.render()[0].decode()
    assert 'kvtier_pins{kvtier_instance="instance-0"} 2.0' in text
    assert 'kvtier_pinned_pages{kvtier_instance="instance-0",tier="host"} 5.0' in text
    assert 'kvtier_l3_pinned_pages{namespace="ns"} 5.0' in text
    for bad in (-0.1, 1.5, "half"):
        with pytest.raises(ConfigError, match="pin_max_fraction"):
            ServeSettings(model="tiny", pin_max_fraction=bad)
