"""Cache events: what an instance tells the router about the pages it holds, per tier.

The router cannot ask every instance about every request (a round trip per instance per
request), so each instance pushes small batches of changes instead and the router keeps an
approximate index (`kvtier.frontend.router_index`). The page hashes are the namespace's SHA-256
chain keys (`KeyNamespace.page_hashes`), which the router computes from a request's tokens
without asking anyone.

Wire format: a msgpack map per batch, one map per event, enums as their string values (like
`kvtier.messages`). The hashes of one event travel as ONE binary blob of raw 32-byte digests.
Why raw digests and not hex or a 16-byte prefix: hex strings cost 66 bytes a page in msgpack,
raw digests 32 (one header per event, not per page), and unlike a truncated prefix they are
lossless: a decoded event carries exactly the keys `KeyNamespace.page_hashes` returns, so the
router and the cache share one key convention and a record survives a round trip unchanged.

Why not reuse `messages._Record`: its codec knows flat tuples of strings only, and these
records need a tuple of nested records and binary blobs; the checks here follow its rules
(a `type` tag, unknown or missing fields and wrong types raise `MessageError`).
"""
from __future__ import annotations

import enum
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import msgpack

from kvtier.messages import MAX_HASHES, MessageError, unpack_payload
from kvtier.policies import CacheEventKind, CacheTier  # core enums: tiers/ emits them

DIGEST_BYTES = 32
MAX_INSTANCE_CHARS = 256
DEFAULT_MAX_PENDING_PAGES = 1 << 16  # pages the log holds between drains (about 2 MiB on the wire)
_HASH_RE = re.compile(r"^[0-9a-f]{64}$")


def _check_str(value: Any, where: str, max_chars: int) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= max_chars:
        raise MessageError(f"{where}: expected a string of 1-{max_chars} characters, got "
                           f"{type(value).__name__} {value!r:.40}")
    return value


def _parse_enum(cls: type[enum.Enum], value: Any, where: str) -> Any:
    if isinstance(value, cls):
        return value
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in cls)
        raise MessageError(f"{where}: {value!r:.40} is not one of {choices}") from None


def _check_map(data: Any, name: str, fields: set[str]) -> dict:
    if not isinstance(data, dict):
        raise MessageError(f"expected a {name} map, got {type(data).__name__}")
    unknown = sorted(set(data) - fields - {"type"}, key=str)
    if unknown:
        raise MessageError(f"{name}: unknown field(s) {unknown}; is the peer another version?")
    missing = sorted(fields - set(data))
    if missing:
        raise MessageError(f"{name}: field(s) {missing} missing")
    return data


@dataclass(frozen=True)
class CacheEvent:
    """One change to a run of pages of one instance: `kind` in `tier`, in prefix order."""

    kind: CacheEventKind
    tier: CacheTier
    page_hashes: tuple[str, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", _parse_enum(CacheEventKind, self.kind, "CacheEvent.kind"))
        object.__setattr__(self, "tier", _parse_enum(CacheTier, self.tier, "CacheEvent.tier"))
        if self.kind is CacheEventKind.DEMOTED and self.tier is not CacheTier.DEVICE:
            raise MessageError(f"CacheEvent: only L1 pages are demoted, got tier {self.tier.value}")
        hashes = tuple(self.page_hashes)
        if len(hashes) > MAX_HASHES:
            raise MessageError(f"CacheEvent: {len(hashes)} hashes is over {MAX_HASHES}")
        for h in hashes:
            if not isinstance(h, str) or not _HASH_RE.match(h):
                raise MessageError(f"CacheEvent: page hashes are 64 lowercase hex digits, got "
                                   f"{h!r:.70}")
        object.__setattr__(self, "page_hashes", hashes)

    def to_map(self) -> dict[str, Any]:
        blob = b"".join(bytes.fromhex(h) for h in self.page_hashes)
        return {"kind": self.kind.value, "tier": self.tier.value, "pages": blob}

    @classmethod
    def from_map(cls, data: Any) -> "CacheEvent":
        data = _check_map(data, "CacheEvent", {"kind", "tier", "pages"})
        blob = data["pages"]
        if not isinstance(blob, bytes) or len(blob) % DIGEST_BYTES:
            raise MessageError(f"CacheEvent.pages: expected bytes holding whole {DIGEST_BYTES}-"
                               f"byte digests, got {type(blob).__name__} of length {len(blob)}")
        hashes = tuple(blob[i:i + DIGEST_BYTES].hex() for i in range(0, len(blob), DIGEST_BYTES))
        return cls(data["kind"], data["tier"], hashes)


@dataclass(frozen=True)
class CacheEventBatch:
    """Events of one instance since its previous batch; `seq` grows by one per batch, so the
    router can drop a batch it has seen and notice one it missed."""

    instance: str
    seq: int
    events: tuple[CacheEvent, ...]

    def __post_init__(self) -> None:
        _check_str(self.instance, "CacheEventBatch.instance", MAX_INSTANCE_CHARS)
        if not isinstance(self.seq, int) or isinstance(self.seq, bool) or not 0 < self.seq < 1 << 63:
            raise MessageError(f"CacheEventBatch.seq must be an int in [1, 2**63), got {self.seq!r:.40}")
        events = tuple(self.events)
        if not all(isinstance(e, CacheEvent) for e in events):
            raise MessageError("CacheEventBatch.events must hold CacheEvent records")
        object.__setattr__(self, "events", events)

    @property
    def num_pages(self) -> int:
        return sum(len(e.page_hashes) for e in self.events)

    def to_msgpack(self) -> bytes:
        data = {"type": "CacheEventBatch", "instance": self.instance, "seq": self.seq,
                "events": [e.to_map() for e in self.events]}
        return msgpack.packb(data, use_bin_type=True)

    @classmethod
    def from_msgpack(cls, data: bytes) -> "CacheEventBatch":
        obj = _check_map(unpack_payload("CacheEventBatch", data), "CacheEventBatch",
                         {"type", "instance", "seq", "events"})
        if obj["type"] != "CacheEventBatch":
            raise MessageError(f"expected a CacheEventBatch record, got {obj['type']!r:.60}")
        if not isinstance(obj["events"], list):
            raise MessageError(f"CacheEventBatch.events: expected a list, got "
                               f"{type(obj['events']).__name__}")
        events = tuple(CacheEvent.from_map(e) for e in obj["events"])
        return cls(obj["instance"], obj["seq"], events)


class CacheEventLog:
    """The producer side: the cache's listener, coalesced into batches for the router.

    Why coalesce: between two drains a page may be stored, demoted and evicted; the router
    needs only where it ended up. The log keeps the last change per (page, tier), ordered by
    when it happened, so its memory is bounded by distinct pages, not by traffic. A DEMOTED
    page also records STORED in L2, which keeps the result right however later changes to
    L1 or L2 reorder. Past `max_pending_pages` the oldest changes are dropped (counted in
    `dropped_pages`): the router's index is approximate, a lost change costs a worse choice.
    """

    def __init__(self, instance: str, max_pending_pages: int = DEFAULT_MAX_PENDING_PAGES) -> None:
        self.instance = _check_str(instance, "CacheEventLog.instance", MAX_INSTANCE_CHARS)
        if not 1 <= max_pending_pages <= MAX_HASHES:  # a drained run must fit one event
            raise ValueError(f"max_pending_pages must be in [1, {MAX_HASHES}], got "
                             f"{max_pending_pages}")
        self.max_pending_pages = max_pending_pages
        self.dropped_pages = 0
        self._pending: OrderedDict[tuple[str, CacheTier], CacheEventKind] = OrderedDict()
        self._seq = 0
        self._lock = threading.Lock()  # the cache records, a publisher thread may drain

    def __call__(self, kind: CacheEventKind, tier: CacheTier, page_hashes: Sequence[str]) -> None:
        self.record(kind, tier, page_hashes)

    def __len__(self) -> int:
        return len(self._pending)

    def record(self, kind: CacheEventKind, tier: CacheTier, page_hashes: Iterable[str]) -> None:
        """The listener a `HierarchicalCache` calls (`cache.set_event_listener(log.record)`)."""
        with self._lock:
            for h in page_hashes:
                self._put(h, tier, kind)
                if kind is CacheEventKind.DEMOTED:
                    self._put(h, CacheTier.HOST, CacheEventKind.STORED)
            while len(self._pending) > self.max_pending_pages:
                self._pending.popitem(last=False)
                self.dropped_pages += 1

    def _put(self, page: str, tier: CacheTier, kind: CacheEventKind) -> None:
        key = (page, tier)
        self._pending.pop(key, None)  # re-inserted at the end: the newest change
        self._pending[key] = kind

    def drain(self) -> CacheEventBatch | None:
        """What changed since the last drain as one batch (None when nothing did)."""
        with self._lock:
            if not self._pending:
                return None
            items, self._pending = list(self._pending.items()), OrderedDict()
            self._seq += 1
            seq = self._seq
        events: list[CacheEvent] = []
        run: list[str] = []
        current = None
        for (page, tier), kind in items:  # consecutive changes of one kind and tier: one event
            if (kind, tier) != current:
                if run:
                    events.append(CacheEvent(current[0], current[1], tuple(run)))
                current, run = (kind, tier), []
            run.append(page)
        events.append(CacheEvent(current[0], current[1], tuple(run)))
        return CacheEventBatch(self.instance, seq, tuple(events))
