"""Pinned prefixes over HTTP, without Ray: what `/admin/pin` bodies may hold, a pin's id, and
the listing that merges what every tier says.

A pin body holds either `tokens` (token ids) or `messages` (chat messages, rendered with the
model's chat template as a chat completion renders them), optionally `tenant` and
`cache_salt` (the prefix is the one requests of that tenant with that `cache_salt` hit), and
`ttl_s` (seconds past the last hit, at most MAX_PIN_TTL_S). `DELETE` takes the same body, or
`{"id": ...}`. A pin's id is a digest of its salt and its whole pages, so the same body always
names the same pin.
"""
from __future__ import annotations

import enum
import hashlib
import re
from typing import Any, Mapping, NamedTuple

from kvtier.frontend.admin import MAX_ADMIN_BODY, parse_admin_body
from kvtier.frontend.openai_requests import ApiError, ChatMessage, parse_messages
from kvtier.tiers.cache_pins import PinListing
from kvtier.tiers.page_pins import MAX_PIN_TTL_S, L3PinListing

PIN_FIELDS = ("tokens", "messages", "tenant", "cache_salt", "ttl_s")
MAX_TOKEN_ID = 1 << 32
MAX_CACHE_SALT_CHARS = 256
_ID_RE = re.compile(r"[0-9a-f]{16}")
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")


class PinVerb(enum.Enum):
    """What a call to /admin/pin asks for."""

    PIN = "POST"
    UNPIN = "DELETE"
    LIST = "GET"


class PinBody(NamedTuple):
    """A parsed pin body: `tokens` or `messages` (one of them), or only `pin_id` (DELETE)."""

    tokens: tuple[int, ...] | None
    messages: tuple[ChatMessage, ...] | None
    tenant: str = ""
    cache_salt: str = ""
    ttl_s: float | None = None
    pin_id: str = ""


def _bad(param: str, what: str) -> ApiError:
    return ApiError(400, f"{param}: {what}", param=param)


def parse_pin_body(raw: bytes, delete: bool = False,
                   max_bytes: int = MAX_ADMIN_BODY) -> PinBody:
    """The body of `POST /admin/pin` (`delete`: of `DELETE /admin/pin`); a 4xx ApiError
    naming the field otherwise. `max_bytes`: a pinned document may be as long as a prompt,
    so the server passes its request body limit."""
    body = parse_admin_body(raw, max_bytes)
    allowed = PIN_FIELDS + (("id",) if delete else ())
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise ApiError(400, f"unknown field(s) {unknown}; a pin body holds "
                            f"{', '.join(allowed)}", param=unknown[0])
    if delete and "id" in body:
        if len(body) > 1:
            raise _bad("id", "give a pin's id alone, or the body it was pinned with")
        if not isinstance(body["id"], str) or not _ID_RE.fullmatch(body["id"]):
            raise _bad("id", f"a pin id is 16 hex digits (GET /admin/pin lists them), got "
                             f"{body['id']!r:.40}")
        return PinBody(None, None, pin_id=body["id"])
    if ("tokens" in body) == ("messages" in body):
        raise ApiError(400, "give either tokens (token ids) or messages (chat messages), "
                            "exactly one of them", param="tokens")
    ttl = body.get("ttl_s")
    if "ttl_s" in body or not delete:
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) \
                or not 0 < ttl <= MAX_PIN_TTL_S:
            raise _bad("ttl_s", f"required, a number of seconds in (0, {MAX_PIN_TTL_S:.0f}] "
                                f"(the pin lasts that long past its last hit), got {ttl!r:.40}")
    return PinBody(_tokens(body["tokens"]) if "tokens" in body else None,
                   parse_messages(body["messages"]) if "messages" in body else None,
                   _tenant(body.get("tenant", "")), _cache_salt(body.get("cache_salt", "")),
                   None if ttl is None else float(ttl))


def _tokens(v: Any) -> tuple[int, ...]:
    if not isinstance(v, list) or not v:
        raise _bad("tokens", f"a non-empty list of token ids, got {v!r:.60}")
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < MAX_TOKEN_ID:
            raise _bad(f"tokens[{i}]", f"a token id is an integer in [0, 2**32), got {t!r:.40}")
    return tuple(v)


def _tenant(v: Any) -> str:
    if not isinstance(v, str) or (v and not _TENANT_RE.fullmatch(v)):
        raise _bad("tenant", f"a tenant name of --api-keys-file (1-128 letters, digits, '.', "
                             f"'_', '-'), got {v!r:.60}")
    return v


def _cache_salt(v: Any) -> str:
    if not isinstance(v, str) or len(v) > MAX_CACHE_SALT_CHARS:
        raise _bad("cache_salt", f"a string of at most {MAX_CACHE_SALT_CHARS} characters, as "
                                 f"the requests send it, got {v!r:.60}")
    return v


def pin_id(salt: str, tokens: tuple[int, ...] | list[int]) -> str:
    """The id of the pin of `tokens` (its whole pages) under `salt`."""
    h = hashlib.sha256(b"kvtier-pin-v1")
    data = salt.encode("utf-8", "surrogatepass")
    h.update(len(data).to_bytes(4, "little") + data)
    h.update(b"".join(int(t).to_bytes(4, "little") for t in tokens))
    return h.hexdigest()[:16]


def merge_pins(instances: Mapping[str, list[PinListing]], l3: list[L3PinListing] | None,
               page_size: int, now_s: float) -> list[dict]:
    """/admin/pin's listing (JSON): one entry per pin id from each instance's pins and the L3
    namespace's: its tenant, tokens and pages, its latest expiry (seconds from now, and as a
    Unix time from `now_s`), and the tiers holding it (per instance: pages in L1 and L2; L3:
    pages)."""
    merged: dict[str, dict] = {}

    def entry(pin: PinListing | L3PinListing) -> dict:
        e = merged.setdefault(pin.pin_id, {"id": pin.pin_id, "tenant": pin.tenant,
                                           "pages": 0, "tokens": 0, "expires_in_s": 0.0,
                                           "instances": {}, "l3_pages": None})
        e["pages"] = max(e["pages"], pin.pages)
        e["tokens"] = e["pages"] * page_size
        e["expires_in_s"] = max(e["expires_in_s"], pin.expires_in_s)
        return e

    for name, pins in instances.items():
        for pin in pins:
            entry(pin)["instances"][name] = {"device_pages": pin.device_pages,
                                             "host_pages": pin.host_pages,
                                             "expires_in_s": pin.expires_in_s}
    for l3_pin in l3 or ():
        entry(l3_pin)["l3_pages"] = l3_pin.pages
    for e in merged.values():
        e["expires_at"] = round(now_s + e["expires_in_s"], 3)
    return sorted(merged.values(), key=lambda e: e["id"])
