"""The admin API's two rules, without HTTP: who may call it, and what a body may hold."""
from __future__ import annotations

import hmac
import json

from kvtier.errors import ConfigError
from kvtier.policies import StorageBackendKind
from kvtier.frontend.openai_requests import ApiError, ErrorType
from kvtier.storage_options import parse_storage_options

MAX_ADMIN_BODY = 64 << 10


def _bearer_matches(authorization: str, key: str) -> bool:
    scheme, _, given = authorization.partition(" ")
    given_bytes = given.strip().encode("utf-8", "surrogatepass")  # any str, no encoding error
    return scheme.lower() == "bearer" and hmac.compare_digest(given_bytes, key.encode())


def check_admin_key(authorization: str, admin_key: str) -> None:
    """`Authorization: Bearer <admin key>` or a 401 (compared in constant time)."""
    if not _bearer_matches(authorization, admin_key):
        raise ApiError(401, "admin endpoints need 'Authorization: Bearer <admin key>' with the "
                            "key given with --admin-key, or the generated one in the file "
                            "kvtier serve named at start", err_type=ErrorType.AUTHENTICATION)


def parse_admin_body(raw: bytes, max_bytes: int = MAX_ADMIN_BODY) -> dict:
    """An admin request's JSON object (empty body = {}); attach needs `backend`."""
    if len(raw) > max_bytes:
        raise ApiError(413, f"admin bodies are at most {max_bytes} bytes")
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ApiError(400, f"the body is not valid JSON ({exc})") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    if "backend" in body and not isinstance(body["backend"], str):
        raise ApiError(400, "backend: expected a string such as 'file', 'mooncake' or 'nixl'",
                       param="backend")
    if "options" in body and body["options"] is not None and not isinstance(body["options"],
                                                                             dict):
        raise ApiError(400, "options: expected an object", param="options")
    if "backend" in body:  # checked here, at the edge, not by each instance (same rules)
        try:
            kind = StorageBackendKind.parse(body["backend"], "backend")
        except ConfigError as exc:
            raise ApiError(400, str(exc), param="backend") from None
        try:
            parse_storage_options(kind, body.get("options"))
        except ConfigError as exc:
            raise ApiError(400, f"options: {exc}", param="options") from None
    return body
