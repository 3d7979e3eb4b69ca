"""Typed records that cross actor boundaries, serialized with msgpack (never pickle).

Why not pickle: a pickled object runs code on load and ties both sides to one class
layout; these records are plain maps of scalars, checked field by field on decode, so a
peer of another version or a corrupt payload fails with a clear `MessageError`.

Each record below is a frozen dataclass with `to_msgpack()` / `from_msgpack(data)`. The map
holds a `type` tag and one entry per field; enums travel as their string values, tuples as
lists, nested records as nested maps. The same codec serves other layers' frozen dataclasses
and NamedTuples (`pack_record` / `unpack_record`: the rank boundary's, actors/step_wire.py),
each field checked against its type hint.
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
T = TypeVar("T")


class MessageError(KvtierError, ValueError):
    """A payload that is not a valid record of the expected type (wrong field, type, value)."""


class _Record:
    """msgpack encoding and checked decoding for the frozen dataclasses below and the serve
    graph's (`kvtier.frontend.records`); the codec is `record_to_map` / `record_from_map`, which
    other modules' NamedTuples and dataclasses use directly through `pack_record` /
    `unpack_record`. Fields are bool, int, float, str, bytes, enums, records, `X | None`,
    tuples, dicts, or plain nested lists of scalars."""

    __slots__ = ()

    def to_map(self) -> dict[str, Any]:
        return record_to_map(self)

    def to_msgpack(self) -> bytes:
        return msgpack.packb(self.to_map(), use_bin_type=True)

    @classmethod
    def from_map(cls: type[R], data: Any) -> R:
        return record_from_map(cls, data)

    def to_dict(self) -> dict[str, Any]:
        """Its fields as plain values (JSON's: enums by value, records as dicts), in order."""
        return {f.name: _plain(getattr(self, f.name))
                for f in dataclasses.fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_msgpack(cls: type[R], data: bytes) -> R:
        return cls.from_map(unpack_payload(cls.__name__, data))


Record = _Record  # the base of records defined in other modules (`kvtier.frontend.records`)


def unpack_payload(name: str, data: bytes) -> Any:
    """The msgpack object in `data`, a payload for record `name`: bytes, size-capped, valid.
    Map keys may be ints too (a `dict[int, ...]` field); every key is checked on decode."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise MessageError(f"{name}.from_msgpack takes bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise MessageError(f"{name}: {len(data)} bytes is over {MAX_MESSAGE_BYTES}")
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise MessageError(f"{name}: not a msgpack record ({exc})") from exc


# ---- the codec: any frozen dataclass or NamedTuple with type hints is a record ---------------

def is_record_type(cls: Any) -> bool:
    """A dataclass or a NamedTuple: encoded as a map of its fields with a `type` tag."""
    return isinstance(cls, type) and (dataclasses.is_dataclass(cls)
                                      or (issubclass(cls, tuple) and hasattr(cls, "_fields")))


@functools.cache
def _wire_fields(cls: type) -> tuple[tuple[str, bool], ...]:
    """(name, required) of each field that travels; a dataclass field with metadata
    `{"wire": False}` stays behind (it decodes to its default)."""
    if dataclasses.is_dataclass(cls):
        return tuple((f.name, f.default is dataclasses.MISSING
                      and f.default_factory is dataclasses.MISSING)
                     for f in dataclasses.fields(cls) if f.metadata.get("wire", True))
    defaults = cls._field_defaults  # type: ignore[attr-defined]
    return tuple((name, name not in defaults) for name in cls._fields)  # type: ignore[attr-defined]


class _Plan(typing.NamedTuple):
    """How one record type travels, worked out once: its fields' names, which are required,
    and their decoders."""

    name: str
    encoders: tuple[tuple[str, Any], ...]  # (name, encoder or None: the value as it is)
    known: frozenset[str]
    fields: tuple[tuple[str, bool, Any, str], ...]  # (name, required, decoder, "Type.name")


@functools.cache
def _plan(cls: type) -> _Plan:
    fields = _wire_fields(cls)
    hints = _hints(cls)
    return _Plan(cls.__name__, tuple((n, _encoder(hints[n])) for n, _ in fields),
                 frozenset(n for n, _ in fields) | {"type"},
                 tuple((n, req, _decoder(hints[n]), f"{cls.__name__}.{n}")
                       for n, req in fields))


def record_to_map(record: Any) -> dict[str, Any]:
    """A record as a msgpack-able map: its `type` tag and one entry per field."""
    plan = _plan(type(record))
    out: dict[str, Any] = {"type": plan.name}
    for name, enc in plan.encoders:
        value = getattr(record, name)
        out[name] = value if enc is None else enc(value)
    return out


def record_from_map(cls: type[T], data: Any) -> T:
    """The record of type `cls` in a decoded map, every field checked against its type hint;
    `MessageError` when it is not one."""
    plan = _plan(cls)
    name = plan.name
    if type(data) is not dict or data.get("type") != name:
        got = data.get("type") if isinstance(data, dict) else type(data).__name__
        raise MessageError(f"expected a {name} record, got {got!r:.60}")
    if not plan.known.issuperset(data):
        unknown = sorted(set(data) - plan.known, key=str)  # keys may be bytes or ints too
        raise MessageError(f"{name}: unknown field(s) {unknown}; is the peer another version?")
    values = {}
    for key, required, dec, where in plan.fields:
        if key in data:
            values[key] = dec(data[key], where)
        elif required:
            raise MessageError(f"{name}: field {key!r} is missing")
    try:
        return cls(**values)
    except MessageError:
        raise
    except (ValueError, TypeError) as exc:  # the record's own checks (ConfigError: ValueError)
        raise MessageError(f"{name}: {exc}") from exc


def pack_record(record: Any) -> bytes:
    """A record (dataclass or NamedTuple) as msgpack bytes."""
    return msgpack.packb(record_to_map(record), use_bin_type=True)


def unpack_record(cls: type[T], data: bytes) -> T:
    """The record of type `cls` in msgpack bytes from `pack_record`, checked."""
    return record_from_map(cls, unpack_payload(cls.__name__, data))


def pack_records(records: typing.Iterable[Any]) -> bytes:
    """A list of records of one type as msgpack bytes (a listing: pins, ...)."""
    return msgpack.packb([record_to_map(r) for r in records], use_bin_type=True)


def unpack_records(cls: type[T], data: bytes) -> list[T]:
    """The records of type `cls` in msgpack bytes from `pack_records`, each checked."""
    items = unpack_payload(f"list of {cls.__name__}", data)
    if type(items) is not list:
        raise MessageError(f"expected a list of {cls.__name__} records, got "
                           f"{type(items).__name__}")
    return [record_from_map(cls, item) for item in items]


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
    """A value no annotation pins down (an `Any` field: a flat map's values)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, _SCALARS) or isinstance(value, bytes):
        return value
    if isinstance(value, tuple):
        if hasattr(value, "_fields"):
            return record_to_map(value)
        if all(isinstance(v, _SCALARS) for v in value):
            return list(value)
        return [_encode(v) for v in value]
    if isinstance(value, _Record) or dataclasses.is_dataclass(value):
        return record_to_map(value)
    if isinstance(value, list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    return value


_PLAIN = (bool, int, float, str, bytes)


@functools.cache
def _encoder(hint: Any) -> typing.Callable[[Any], Any] | None:
    """How a field of this annotation is encoded (built once per annotation); None: msgpack
    takes the value as it is."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint in _PLAIN:
        return None
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda v: v.value
    if is_record_type(hint):
        return record_to_map
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        some = _encoder(next(a for a in args if a is not type(None)))
        if some is None:
            return None
        return lambda v: None if v is None else some(v)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _encoder(args[0])
        if item is None:
            return list
        return lambda v: [item(x) for x in v]
    if origin is tuple:
        items = [_encoder(a) for a in args]
        if all(e is None for e in items):
            return list
        return lambda v: [x if e is None else e(x) for e, x in zip(items, v)]
    if origin is dict:
        key, val = _encoder(args[0]), _encoder(args[1])
        if key is None and val is None:
            return None
        return lambda v: {(k if key is None else key(k)): (x if val is None else val(x))
                          for k, x in v.items()}
    return _encode


def _fail(hint: Any, value: Any, where: str) -> typing.NoReturn:
    raise MessageError(f"{where}: expected {getattr(hint, '__name__', hint)}, got "
                       f"{type(value).__name__} {value!r:.40}")


@functools.cache
def _decoder(hint: Any) -> typing.Callable[[Any, str], Any]:
    """The checking decoder of one annotation (built once per annotation)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is bool:
        def dec(v: Any, where: str) -> Any:
            return v if isinstance(v, bool) else _fail(hint, v, where)
    elif hint is int:
        def dec(v: Any, where: str) -> Any:
            return v if type(v) is int else _fail(hint, v, where)
    elif hint is float:
        def dec(v: Any, where: str) -> Any:
            if (type(v) is float or type(v) is int) and math.isfinite(v):
                return float(v)
            _fail(hint, v, where)
    elif hint is str:
        def dec(v: Any, where: str) -> Any:
            return v if isinstance(v, str) else _fail(hint, v, where)
    elif hint is bytes:
        def dec(v: Any, where: str) -> Any:
            return v if isinstance(v, bytes) else _fail(hint, v, where)
    elif hint is Any:  # a flat map's values: scalars
        def dec(v: Any, where: str) -> Any:
            return v if isinstance(v, _SCALARS) else _fail("a scalar", v, where)
    elif isinstance(hint, type) and issubclass(hint, enum.Enum):
        def dec(v: Any, where: str) -> Any:
            try:
                return hint(v)
            except ValueError:
                choices = ", ".join(str(m.value) for m in hint)
                raise MessageError(f"{where}: {v!r:.40} is not one of {choices}") from None
    elif isinstance(hint, type) and issubclass(hint, _Record):
        def dec(v: Any, where: str) -> Any:
            return hint.from_map(v)
    elif is_record_type(hint):
        def dec(v: Any, where: str) -> Any:
            return record_from_map(hint, v)
    elif hint is list:  # plain nested lists of scalars (a wire form such as log-probabilities)
        def dec(v: Any, where: str) -> Any:
            return v if isinstance(v, list) and _plain_list(v) else _fail(hint, v, where)
    elif origin in (typing.Union, types.UnionType):  # X | None
        inner = [a for a in args if a is not type(None)]
        if len(inner) != 1 or len(args) != 2:
            raise AssertionError(f"no decoder for {hint}: only X | None")
        some = _decoder(inner[0])

        def dec(v: Any, where: str) -> Any:
            return None if v is None else some(v, where)
    elif origin is tuple and len(args) == 2 and args[1] is Ellipsis:  # tuple[X, ...]
        item = _decoder(args[0])
        if args[0] in (int, str):
            kind = args[0]

            def dec(v: Any, where: str) -> Any:
                if isinstance(v, list) and all(type(x) is kind for x in v):
                    return tuple(v)  # the common case, checked in one pass
                if not isinstance(v, list):
                    _fail(hint, v, where)
                return tuple([item(x, f"{where}[{i}]") for i, x in enumerate(v)])  # says where
        else:
            def dec(v: Any, where: str) -> Any:
                if not isinstance(v, list):
                    _fail(hint, v, where)
                try:
                    return tuple([item(x, where) for x in v])
                except MessageError:  # again, to say which item: a failure's path only
                    return tuple([item(x, f"{where}[{i}]") for i, x in enumerate(v)])
    elif args == (int, float):  # (token, logprob): many per token, so checked inline
        def dec(v: Any, where: str) -> Any:
            if type(v) is list and len(v) == 2:
                a, b = v
                if type(a) is int and (type(b) is float or type(b) is int) and math.isfinite(b):
                    return (a, float(b))
            _fail(hint, v, where)
    elif origin is tuple:  # tuple[X, Y]: a fixed pair of plain values
        items = [_decoder(a) for a in args]

        def dec(v: Any, where: str) -> Any:
            if not isinstance(v, list) or len(v) != len(items):
                _fail(hint, v, where)
            return tuple([d(x, where) for d, x in zip(items, v)])
    elif origin is dict:
        key, val = _decoder(args[0]), _decoder(args[1])

        def dec(v: Any, where: str) -> Any:
            if not isinstance(v, dict):
                _fail(hint, v, where)
            return {key(k, where): val(x, where) for k, x in v.items()}
    else:
        raise AssertionError(f"no decoder for {hint}")
    return dec


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


MAX_HOLDER_CHARS = 256
MAX_INCARNATION_CHARS = 128


def _check_holder(holder: str, where: str) -> None:
    if not isinstance(holder, str) or not 0 < len(holder) <= MAX_HOLDER_CHARS:
        raise MessageError(f"{where}: a holder is a name of 1-{MAX_HOLDER_CHARS} characters, "
                           f"got {holder!r:.40}")


def _check_incarnation(incarnation: str, where: str) -> None:
    if not isinstance(incarnation, str) or not 0 < len(incarnation) <= MAX_INCARNATION_CHARS:
        raise MessageError(f"{where}: an incarnation is an id of 1-{MAX_INCARNATION_CHARS} "
                           f"characters, one per start of the holder (tiers/l2_holders."
                           f"new_incarnation), got {incarnation!r:.40}")


class L2Standing(enum.Enum):
    """How the directory took a holder incarnation's L2Report (tiers/l2_holders.py)."""

    LISTED = "listed"  # it kept this incarnation's listing: the report applied on top
    UNLISTED = "unlisted"  # it kept none (first report, lease expired, directory restarted):
    # the report applied to an empty listing; the holder's next report lists everything
    RETIRED = "retired"  # a replaced or forgotten incarnation: the report was ignored


@dataclass(frozen=True)
class L2Report(_Record):
    """What one holder (an instance's L2, host memory) gained and lost of a namespace's
    pages since its last report; `replace`: `held` is everything it holds now. An empty
    report renews the holder's lease. `incarnation`: this start of the holder."""

    namespace: str
    holder: str
    incarnation: str
    held: tuple[str, ...]
    dropped: tuple[str, ...] = ()
    replace: bool = False

    def __post_init__(self) -> None:
        _check_holder(self.holder, "L2Report.holder")
        _check_incarnation(self.incarnation, "L2Report.incarnation")
        _check_hashes(self.held, "L2Report.held")
        _check_hashes(self.dropped, "L2Report.dropped")


@dataclass(frozen=True)
class L2Receipt(_Record):
    """The directory's answer to an L2Report: the pages the holder lists now, and how it
    took the report."""

    pages: int
    standing: L2Standing


@dataclass(frozen=True)
class L2Forget(_Record):
    """Incarnation `incarnation` of holder `holder` stopped: it holds nothing any more (a
    newer incarnation of the same name is left alone)."""

    holder: str
    incarnation: str

    def __post_init__(self) -> None:
        _check_holder(self.holder, "L2Forget.holder")
        _check_incarnation(self.incarnation, "L2Forget.incarnation")


@dataclass(frozen=True)
class L2Holding(_Record):
    """`holder` holds the first `pages` pages asked about in its L2."""

    holder: str
    pages: int


@dataclass(frozen=True)
class L2Listing(_Record):
    """Who holds a leading run of the pages asked about in L2, the longest run first."""

    namespace: str
    holders: tuple[L2Holding, ...] = ()


@dataclass(frozen=True)
class PeerRank(_Record):
    """One TP rank of an instance that lends its L2 pages to peers: the KV heads it holds
    (global indices `[head_start, head_stop)` of the model's), its Ray actor (`actor`, a
    named actor in Ray namespace `ray_namespace`; for the logs), and what a peer reads it
    with: its transport endpoint's `address`, its `page_head` L2 at `l2_addr` of
    `pool_pages` pages, and the table of those pages at `table_addr` (tiers/peer_table.py)."""

    rank: int
    size: int
    head_start: int
    head_stop: int
    actor: str
    ray_namespace: str
    address: bytes = b""
    l2_addr: int = 0
    pool_pages: int = 0
    table_addr: int = 0


@dataclass(frozen=True)
class PeerContact(_Record):
    """How to reach holder `holder`'s L2 (every rank of it) for namespace `namespace`."""

    namespace: str
    holder: str
    ranks: tuple[PeerRank, ...] = ()

    def __post_init__(self) -> None:
        _check_holder(self.holder, "PeerContact.holder")


@dataclass(frozen=True)
class PeerRegistration(_Record):
    """Rank `rank` of holder `holder` (its start `incarnation`) lends the L2 pages of
    namespace `namespace` to peers."""

    namespace: str
    holder: str
    incarnation: str
    rank: PeerRank

    def __post_init__(self) -> None:
        _check_holder(self.holder, "PeerRegistration.holder")
        _check_incarnation(self.incarnation, "PeerRegistration.incarnation")


@dataclass(frozen=True)
class PeerQuery(_Record):
    """Which peer other than `asker` holds the longest leading run of `hashes` in L2?"""

    namespace: str
    asker: str
    hashes: tuple[str, ...]

    def __post_init__(self) -> None:
        _check_hashes(self.hashes, "PeerQuery.hashes")


@dataclass(frozen=True)
class PeerOffer(_Record):
    """The answer to a PeerQuery: `pages` leading pages held by the peer `contact` reaches
    (0 and None: no peer holds the first page)."""

    namespace: str
    pages: int
    contact: PeerContact | None = None


@dataclass(frozen=True)
class PeerLend(_Record):
    """Where a holder rank holds the leading run of a prefix's pages, as its table lists them
    (tiers/peer_pages.PeerReader.lookup): `host_pages` of its `page_head` pool at
    `base_addr`, of `pool_pages` pages and `pool_heads` heads, one xxh3_64 per (page, head
    wanted) of the head's K then V object, page by page, and its transport endpoint's
    address. Empty `host_pages`: it lists none of them (evicted, or never had them)."""

    host_pages: tuple[int, ...]
    sums: tuple[int, ...]
    base_addr: int
    pool_pages: int
    pool_heads: int
    address: bytes


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
    l2_pages: int = 0  # gauge: pages some instance holds in L2 (as they reported)
    l2_holders: int = 0  # gauge: instances holding pages in L2
    peer_holders: int = 0  # gauge: instances whose every rank lends its L2 to peers


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
