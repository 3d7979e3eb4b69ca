"""Tenants of one deployment: API keys mapped to tenants, and the cache salt of a request.

A deployment may serve several tenants from the same instances. Each request's prefixes are
cached under a salt made of its tenant (the one its API key maps to) and its own optional
`cache_salt` field (vLLM's): every cache tier keys pages by the salt, so a request hits only
prefixes cached by requests with the same tenant and the same `cache_salt`. Without keys
mapped to tenants and without `cache_salt`, every request shares one cache, as before.

The keys file is a JSON object, API key -> tenant name:
    {"sk-acme-1": "acme", "sk-acme-2": "acme", "sk-globex": "globex"}
Several keys may name one tenant (they share its prefixes).
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping

from kvtier.errors import ConfigError
from kvtier.frontend.openai_requests import ApiError, ErrorType

MAX_API_KEYS = 10_000
MIN_API_KEY_CHARS = 8
MAX_API_KEY_CHARS = 4096
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]{0,127}")


def check_api_keys(keys: Any, where: str = "api_keys") -> dict[str, str]:
    """API key -> tenant, checked: keys of 8-4096 printable characters without spaces,
    tenants of 1-128 letters, digits, '.', '_', '-'."""
    if not isinstance(keys, Mapping):
        raise ConfigError(f"{where}: expected a JSON object of API key -> tenant, got "
                          f"{type(keys).__name__}")
    if len(keys) > MAX_API_KEYS:
        raise ConfigError(f"{where}: at most {MAX_API_KEYS} keys, got {len(keys)}")
    out: dict[str, str] = {}
    for key, tenant in keys.items():
        if not isinstance(key, str) or not MIN_API_KEY_CHARS <= len(key) <= MAX_API_KEY_CHARS \
                or not key.isprintable() or any(c.isspace() for c in key):
            raise ConfigError(f"{where}: an API key must be {MIN_API_KEY_CHARS}-"
                              f"{MAX_API_KEY_CHARS} printable characters without spaces "
                              f"(key {str(key)[:4]!r}...)")
        if not isinstance(tenant, str) or not _TENANT_RE.fullmatch(tenant):
            raise ConfigError(f"{where}: the tenant of key {key[:4]!r}... must be 1-128 "
                              f"letters, digits, '.', '_' or '-', got {tenant!r}")
        out[key] = tenant
    return out


def load_api_keys(path: str) -> dict[str, str]:
    """The keys file at `path` (see the module doc), checked."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as exc:
        raise ConfigError(f"api_keys_file {path!r}: cannot read it ({exc.strerror})") from None
    except ValueError as exc:
        raise ConfigError(f"api_keys_file {path!r}: not JSON ({exc}); write an object like "
                          f'{{"sk-...": "tenant-a"}}') from None
    return check_api_keys(data, f"api_keys_file {path!r}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """Who may call the OpenAI endpoints, and as which tenant.

    `api_key` (one key, the default tenant "") and `keys` (key -> tenant) may both be given;
    with neither the endpoints are open. Keys are kept and compared as SHA-256 digests, so
    a lookup's time does not depend on how much of a guess matches."""

    def __init__(self, keys: Mapping[str, str] | None = None, api_key: str = "") -> None:
        self._tenants = {_digest(k): t for k, t in check_api_keys(dict(keys or {})).items()}
        if api_key:
            self._tenants.setdefault(_digest(api_key), "")

    @property
    def open(self) -> bool:
        return not self._tenants

    def tenant(self, authorization: str) -> str:
        """The tenant of the request's `Authorization: Bearer <key>` ("" when the endpoints
        are open); a 401 ApiError when the key is missing or unknown."""
        if self.open:
            return ""
        scheme, _, given = authorization.partition(" ")
        tenant = self._tenants.get(_digest(given.strip())) if scheme.lower() == "bearer" \
            else None
        if tenant is None:
            raise ApiError(401, "this server needs 'Authorization: Bearer <api key>' with a "
                                "key it was started with (--api-key or --api-keys-file)",
                           err_type=ErrorType.AUTHENTICATION)
        return tenant


def request_salt(tenant: str, cache_salt: str) -> str:
    """The cache salt of a request: "" for the default tenant without a `cache_salt` (every
    such request shares prefixes), else a digest of both (length-prefixed: no two pairs
    give one salt)."""
    if not tenant and not cache_salt:
        return ""
    h = hashlib.sha256(b"kvtier-tenant-v1")
    for part in (tenant, cache_salt):
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(4, "little") + data)
    return h.hexdigest()[:32]
