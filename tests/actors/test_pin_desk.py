"""The pin desk's reading of a body, without Ray: a chat pin's tokens lead every chat
completion prompt that starts with its messages, and its salt is the one that tenant's
requests carry."""
from __future__ import annotations

import json

import pytest

from kvtier.actors.pins import PinDesk
from kvtier.frontend import served_model
from kvtier.frontend.openai_requests import ApiError, ApiLimits
from kvtier.frontend.pins import parse_pin_body
from kvtier.frontend.settings import ServeSettings
from kvtier.frontend.tenants import request_salt

SETTINGS = ServeSettings(model="tiny", api_keys={"sk-acme-0001": "acme"})
LEADING = [{"role": "system", "content": "You answer in one line."},
           {"role": "user", "content": "Record 1?"}, {"role": "assistant", "content": "R1."}]


@pytest.fixture(scope="module")
def desk() -> PinDesk:
    tokenizer = served_model.tokenizer(SETTINGS)
    limits = ApiLimits(model_names=("m",), max_prompt_tokens=4096, max_new_tokens=16)
    return PinDesk(None, {}, None, SETTINGS, tokenizer, limits, 1.0)


def body(**kw) -> bytes:
    return json.dumps({"messages": LEADING, "ttl_s": 60, **kw}).encode()


def test_a_chat_pin_leads_the_prompts_of_chats_that_start_with_its_messages(desk):
    tokens, salt = desk._prefix(parse_pin_body(body()))
    assert salt == ""
    for later in ([], [{"role": "user", "content": "And record 2?"}]):
        prompt = desk.tokenizer.encode_chat(LEADING + later)  # as a chat completion renders
        assert prompt[: len(tokens)] == tokens and len(prompt) > len(tokens)


def test_a_pin_is_salted_as_its_tenants_requests_are(desk):
    _, salt = desk._prefix(parse_pin_body(body(tenant="acme", cache_salt="s1")))
    assert salt == request_salt("acme", "s1") != request_salt("acme", "")
    with pytest.raises(ApiError, match="not a tenant of this server") as err:
        desk._prefix(parse_pin_body(body(tenant="globex")))
    assert err.value.status == 400
