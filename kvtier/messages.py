"""Typed records that cross actor boundaries, serialized with msgpack (never pickle).

Why not pickle: a pickled object runs code on load and ties both sides to one class
layout; these records are plain maps of scalars, checked field by field on decode, so a
peer of another version or a corrupt payload fails with a clear `MessageError`.

Each record is a frozen dataclass with `to_msgpack()` / `from_msgpack(data)`. The map holds
a `type` tag and one entry per field; enums travel as their string values, tuples as lists,
nested records as nested maps.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgpack

from kvtier.errors import KvtierError
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import MAX_KV_HEADS
from kvtier.policies import StorageBackendKind
from kvtier.storage_options import (FileOptions, NixlOptions, SimulatedOptions, StorageOptions,
                                    check_int, parse_storage_options)

MAX_MESSAGE_BYTES = 16 << 20  # a lookup of ~200k page hashes; larger payloads are refused
MAX_HASHES = 1 << 17
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_SCALARS = (str, int, float, bool, type(None))
R = TypeVar("R", bound="_Record")


class MessageError(KvtierError, ValueError):
    """A payload that is not a valid record of the expected type (wrong field, type, value)."""


class _Record:
    """msgpack encoding and checked decoding for the frozen dataclasses below (and the serve
    graph's, `kvtier.serve.records`): fields are bool, int, float, str, bytes, enums, records,
    `X | None`, tuple[X, ...], flat dicts of scalars, or plain nested lists of scalars."""

    __slots__ = ()

    def to_map(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": type(self).__name__}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            out[f.name] = _encode(getattr(self, f.name))
        return out

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_map(), use_bin_type=True)

    @classmethod
    def from_map(cls: type[R], data: Any) -> R:
        name = cls.__name__
        if not isinstance(data, dict) or data.get("type") != name:
            got = data.get("type") if isinstance(data, dict) else type(data).__name__
            raise MessageError(f"expected a {name} record, got {got!r:.60}")
        fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - set(fields) - {"type"}, key=str)  # keys may be bytes too
        if unknown:
            raise MessageError(f"{name}: unknown field(s) {unknown}; is the peer another version?")
        hints = _hints(cls)
        values = {}
        for key, f in fields.items():
            if key in data:
                values[key] = _decode(data[key], hints[key], f"{name}.{key}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise MessageError(f"{name}: field {key!r} is missing")
        try:
            return cls(**values)
        except MessageError:
            raise
        except ValueError as exc:  # the record's own checks (ConfigError is a ValueError)
            raise MessageError(f"{name}: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """Its fields as plain values (JSON's: enums by value, records as dicts), in order."""
        return {f.name: _plain(getattr(self, f.name))
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_msgpack(cls: type[R], data: bytes) -> R:
        return cls.from_map(unpack_payload(cls.__name__, data))


Record = _Record  # the base of records defined in other modules (`kvtier.serve.records`)


def unpack_payload(name: str, data: bytes) -> Any:
    """The msgpack object in `data`, a payload for record `name`: bytes, size-capped, valid."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"{name}.from_msgpack takes bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{name}: {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MessageError(f"{name}: not a msgpack record ({exc})") from exc


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # resolving string annotations costs ~50 us: once


def _plain(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_dict()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return dict(value)
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return value


def _encode(value: Any) -> Any:
    if isinstance(value, _Record):
        return value.to_map()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    return value


def _decode(value: Any, hint: Any, where: str) -> Any:
    """Check one decoded field against its annotation; returns the field's value."""
    origin = typing.get_origin(hint)
    if hint is bool:
        if isinstance(value, bool):
            return value
    elif hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif hint is str:
        if isinstance(value, str):
            return value
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            choices = ", ".join(str(m.value) for m in hint)
            raise MessageError(f"{where}: {value!r:.40} is not one of {choices}") from None
    elif isinstance(hint, type) and issubclass(hint, _Record):
        return hint.from_map(value)
    elif origin in (types.UnionType, typing.Union):  # X | None
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _decode(value, inner, where)
    elif origin is tuple:  # tuple[X, ...]: str, int, bytes or records
        if isinstance(value, list):
            (item, _) = typing.get_args(hint)
            return tuple(_decode(v, item, f"{where}[{i}]") for i, v in enumerate(value))
    elif hint is bytes:
        if isinstance(value, bytes):
            return value
    elif hint is list:  # plain nested lists of scalars (a wire form such as log-probabilities)
        if isinstance(value, list) and _plain_list(value):
            return value
    elif origin is dict:  # storage options: a flat map of scalars
        if isinstance(value, dict) and all(isinstance(v, _SCALARS) for v in value.values()):
            return dict(value)
    else:
        raise AssertionError(f"{where}: no decoder for {hint}")
    raise MessageError(f"{where}: expected {getattr(hint, '__name__', hint)}, got "
                       f"{type(value).__name__} {value!r:.40}")


def _plain_list(value: list, depth: int = 0) -> bool:
    return depth < 8 and all(_plain_list(v, depth + 1) if isinstance(v, list)
                             else isinstance(v, _SCALARS) for v in value)


def _check_hashes(hashes: tuple[str, ...], where: str) -> None:
    if len(hashes) > MAX_HASHES:
        raise MessageError(f"{where}: {len(hashes)} hashes is over {MAX_HASHES}; split the call")
    for h in hashes:
        if not isinstance(h, str) or not _HASH_RE.match(h):
            raise MessageError(f"{where}: page hashes are 64 lowercase hex digits, got {h!r:.70}")


# ---- the records ----------------------------------------------------------------------------

@dataclass(frozen=True)
class NamespaceSpec(_Record):
    """What a caller registers: who shares pages, where they live, the model's KV heads, a quota.

    `kv_heads` is the model's total KV heads (not a rank's share): a page is published when
    every head's objects are stored, whichever ranks of whichever TP sizes wrote them, so
    instances of any TP size share the namespace. `max_pages` and `max_bytes` bound the
    published pages (0 = unbounded); `max_bytes` needs `page_bytes`, the bytes of one page
    over every KV head and part.

    A backend's own bound in `options` (file/nixl `max_size_bytes`, simulated
    `capacity_pages`) is folded into the namespace's quota, and the ranks' clients are opened
    without it: each process evicting on its own would delete pages the directory still
    advertises, so under a namespace only the directory evicts. `max_size_bytes` counts bytes
    and the quota counts pages, so it needs `page_bytes` too.
    """

    model: str
    tenant_salt: str = ""
    layout_fingerprint: str = ""
    backend: StorageBackendKind = StorageBackendKind.FILE
    options: dict[str, Any] = field(default_factory=dict, hash=False)
    kv_heads: int = 1
    max_pages: int = 0
    max_bytes: int = 0
    page_bytes: int = 0
    sliding: bool = False  # a hybrid model's: pages also have sliding-window objects (swa pool)

    def __post_init__(self) -> None:
        KeyNamespace(self.model, self.tenant_salt, self.layout_fingerprint)  # ConfigError if bad
        object.__setattr__(self, "backend", StorageBackendKind.parse(self.backend, "backend"))
        check_int(self.kv_heads, "NamespaceSpec.kv_heads", 1, MAX_KV_HEADS)
        for name in ("max_pages", "max_bytes", "page_bytes"):
            check_int(getattr(self, name), f"NamespaceSpec.{name}", 0, 1 << 62)
        if self.max_bytes and not self.page_bytes:
            raise MessageError("NamespaceSpec: max_bytes needs page_bytes (bytes of one page over "
                               "all KV heads and parts); set it, or use max_pages")
        if self.backend_bound.max_bytes and not self.page_bytes:  # validates the options too
            raise MessageError(
                f"NamespaceSpec: options.max_size_bytes={self.backend_bound.max_bytes} becomes "
                "the namespace's page quota (only the namespace directory evicts), which needs "
                "page_bytes (bytes of one page over all KV heads and parts): set page_bytes, "
                "or drop max_size_bytes and set max_pages")

    @property
    def key_namespace(self) -> KeyNamespace:
        return KeyNamespace(self.model, self.tenant_salt, self.layout_fingerprint)

    @property
    def namespace(self) -> str:
        """The namespace's id everywhere: its storage name (digest of model, salt, layout)."""
        return self.key_namespace.name

    @functools.cached_property
    def backend_bound(self) -> "BackendBound":
        """The bound the backend's own options ask for (folded into `capacity_pages`)."""
        return backend_bound(self.storage_options())

    @functools.cached_property
    def capacity_pages(self) -> int:
        """The page quota (0 = unbounded): the tightest of max_pages, max_bytes and the
        backend's own bound (options.max_size_bytes or capacity_pages)."""
        pages = max(self.page_bytes, 1)
        bound = self.backend_bound
        caps = [c for c in (self.max_pages, self.max_bytes and self.max_bytes // pages,
                            bound.max_bytes and bound.max_bytes // pages, bound.max_pages) if c]
        return max(1, min(caps)) if caps else 0

    def storage_options(self, options: dict[str, Any] | None = None) -> StorageOptions:
        return parse_storage_options(self.backend, self.options if options is None else options)


class BackendBound(typing.NamedTuple):
    """A backend's own eviction bound from its options (0 = none)."""

    max_bytes: int  # file / nixl: max_size_bytes
    max_pages: int  # simulated: capacity_pages


def backend_bound(options: StorageOptions) -> BackendBound:
    if isinstance(options, (FileOptions, NixlOptions)):
        return BackendBound(options.max_size_bytes, 0)
    if isinstance(options, SimulatedOptions):
        return BackendBound(0, options.capacity_pages)
    return BackendBound(0, 0)  # Mooncake: its master evicts by itself, out of our hands


@dataclass(frozen=True)
class NamespaceInfo(_Record):
    """What ranks need to open their own backend clients for a namespace.

    `options` are the spec's, resolved (for a supervised Mooncake master: its address);
    `epoch` grows whenever they change, so a rank whose backend stops answering can ask
    again and re-attach when the epoch moved. `root_marker` (file, nixl) is the token of the
    marker the namespace actor wrote into root_dir: each rank reads it back before attaching
    (backends/shared_root.py); "" when none was written.
    """

    namespace: str
    spec: NamespaceSpec
    options: dict[str, Any] = field(hash=False)
    epoch: int = 0
    root_marker: str = ""

    def storage_options(self) -> StorageOptions:
        return self.spec.storage_options(self.options)


@dataclass(frozen=True)
class StoredReport(_Record):
    """A writer rank stored the objects of KV heads [head_start, head_stop) of these pages."""

    namespace: str
    head_start: int
    head_stop: int
    hashes: tuple[str, ...]

    def __post_init__(self) -> None:
        check_int(self.head_start, "StoredReport.head_start", 0, MAX_KV_HEADS - 1)
        check_int(self.head_stop, "StoredReport.head_stop", self.head_start + 1, MAX_KV_HEADS)
        _check_hashes(self.hashes, "StoredReport.hashes")


@dataclass(frozen=True)
class MissingReport(_Record):
    """A reader of the namespace found these published pages missing or corrupt in storage."""

    namespace: str
    hashes: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_hashes(self.hashes, "MissingReport.hashes")


@dataclass(frozen=True)
class LookupRequest(_Record):
    """How many leading pages of `hashes` are published; with `lease_ttl_s` > 0, lease them."""

    namespace: str
    hashes: tuple[str, ...]
    lease_ttl_s: float = 0.0

    def __post_init__(self) -> None:
        _check_hashes(self.hashes, "LookupRequest.hashes")
        if not 0.0 <= self.lease_ttl_s <= 86400.0:
            raise MessageError(f"LookupRequest.lease_ttl_s must be in [0, 86400], got "
                               f"{self.lease_ttl_s}")


@dataclass(frozen=True)
class LeaseGrant(_Record):
    """A lease on the first `pages` pages asked for; `lease_id` is "" when nothing was leased."""

    lease_id: str
    namespace: str
    pages: int
    ttl_s: float


@dataclass(frozen=True)
class LookupResult(_Record):
    """Leading published pages, and the lease on them when one was asked for."""

    namespace: str
    hit_pages: int
    lease_id: str = ""


@dataclass(frozen=True)
class DirectoryStats(_Record):
    """Per-namespace counters of the page directory (monotonic, except the gauges)."""

    namespace: str
    published_pages: int  # gauge
    pending_pages: int  # gauge: some ranks reported, not all yet
    capacity_pages: int  # 0 = unbounded
    leases_active: int  # gauge
    leases_granted: int
    leases_expired: int
    evicted_pages: int
    expired_pending_pages: int  # writers that never finished a page
    hit_pages: int
    miss_pages: int
    lookups: int
    rebuilt_pages: int  # published from the backend's listing at the last rebuild
    delete_failures: int
    epoch: int
    vanished_pages: int = 0  # published pages a reader found missing or corrupt (unpublished)
    doomed_pages: int = 0  # gauge: pages queued for deletion or being deleted
    old_format_pages_reclaimed: int = 0  # format-1 pages (named by TP rank) found and deleted
    purged_pages: int = 0  # pages deleted by purges (POST /admin/purge)
    pins: int = 0  # gauge: pinned prefixes
    pinned_pages: int = 0  # gauge: published pages pins keep past the quota
    expired_pins: int = 0


@dataclass(frozen=True)
class PinRequest(_Record):
    """Pin the leading published pages of `hashes` for `ttl_s` past their last hit, within
    `max_fraction` of the namespace's quota."""

    namespace: str
    pin_id: str
    hashes: tuple[str, ...]
    ttl_s: float
    max_fraction: float
    tenant: str = ""

    def __post_init__(self) -> None:
        _check_hashes(self.hashes, "PinRequest.hashes")
        if not 1 <= len(self.pin_id) <= 64 or len(self.tenant) > 128:
            raise MessageError("PinRequest: pin_id is 1-64 characters, tenant at most 128")
        if not 0.0 <= self.max_fraction <= 1.0:
            raise MessageError(f"PinRequest.max_fraction must be in [0, 1], got "
                               f"{self.max_fraction}")


@dataclass(frozen=True)
class PinGrant(_Record):
    """What a pin got: `pages` pinned, or a refusal (`refusal` says why) that needed
    `needed_pages` with `free_pages` free for pins."""

    namespace: str
    pin_id: str
    pages: int
    refusal: str = ""
    needed_pages: int = 0
    free_pages: int = 0
