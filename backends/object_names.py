"""L3 object names: which objects a page is, and what each is called.

Objects: a page is stored as one object per KV head and part (K, V), named
`<namespace>/<pool>/<hash>_h<head>_<k|v>` with the model's GLOBAL head index, so instances of
any TP size share them: a rank reads and writes exactly the heads it owns. The host pool lays
each head's bytes of a page out contiguously (`page_head_view`, the `page_head` layout), so a
head object moves in place; a batch call carries every head's objects of many pages, so the
calls per page do not grow with the head count.

Old format: objects of format 1 were named by TP rank and size (`<hash>_<rank>_<size>_<k|v>`)
in namespaces whose fingerprint said v1. They are never read (the v2 fingerprint gives every
namespace another name, and v2 names never match them); a listable backend finds them with
`reclaim_old_format`, which removes them from this namespace's own pool folder and from every
other namespace folder of the same model (`<model>-<digest>/<pool>`), and counts the pages.
"""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Iterable, NamedTuple

from kvtier.errors import CacheUsageError
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import HeadRange

_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_OBJECT_RE = re.compile(r"^([0-9a-f]{64})_h(\d{1,4})_([kv])$")  # object_name's last part
# Format 1 (before objects named heads): `<hash>_<rank>_<size>_<k|v>`; never read, reclaimed.
_OLD_OBJECT_RE = re.compile(r"^([0-9a-f]{64})_(\d{1,4})_(\d{1,4})_([kv])$")


class PagePart(enum.IntEnum):
    """A page of the KV pool is two objects: its K bytes and its V bytes (all layers)."""

    K = 0
    V = 1

    @property
    def suffix(self) -> str:
        return "k" if self is PagePart.K else "v"


@dataclass(frozen=True)
class StorageTarget:
    """Whose objects: a namespace, and the KV heads (of the model's total) this client owns.

    Objects are named by page hash and GLOBAL KV head, never by TP rank or size, so a writer
    at one TP size and a reader at another name the same objects (module docstring)."""

    namespace: KeyNamespace
    heads: HeadRange = HeadRange(0, 1, 1)

    def __post_init__(self) -> None:
        if not isinstance(self.heads, HeadRange):
            raise CacheUsageError(f"StorageTarget.heads must be a HeadRange, got {self.heads!r}")

    def object_name(self, pool: str, page_hash: str, head: int, part: int) -> str:
        """`<namespace>/<pool>/<hash>_h<head>_<k|v>`: nothing in it is client text.

        The namespace name is validated (KeyNamespace), the hash must be 64 hex digits, the
        pool a short identifier and the head one of the model's, so no name can become `..`
        or reach another namespace.
        """
        check_page_hash(page_hash)
        if not 0 <= head < self.heads.total:
            raise CacheUsageError(f"KV head {head} is outside 0..{self.heads.total - 1}")
        return f"{self.namespace.name}/{pool}/{page_hash}_h{head}_{PagePart(part).suffix}"

    def slots(self, num_parts: int) -> tuple["ObjectSlot", ...]:
        """The objects of one page this target reads and writes: per owned head, its parts."""
        return tuple(ObjectSlot(h, h - self.heads.start, PagePart(part))
                     for h in self.heads.heads() for part in range(num_parts))


class ObjectSlot(NamedTuple):
    """One object of a page: KV head `head` (global; `local_head` in the rank's pool), part."""

    head: int
    local_head: int
    part: PagePart


def check_page_hash(page_hash: str) -> str:
    if not isinstance(page_hash, str) or not _HASH_RE.match(page_hash):
        raise CacheUsageError(f"page keys are 64 lowercase hex digits, got {page_hash!r:.80}")
    return page_hash


def page_heads(basenames: Iterable[str], total_heads: int,
               num_parts: int = len(PagePart)) -> dict[str, set[int]]:
    """Group object basenames (`<hash>_h<head>_<k|v>`) of one namespace/pool into page hash ->
    KV heads (of `total_heads`) whose every part is among them. Heads outside the model and
    names that are not objects (format-1 names too) are ignored; pages keep the order they
    first appear in."""
    want = {PagePart(p).suffix for p in range(num_parts)}
    parts: dict[str, dict[int, set[str]]] = {}
    for base in basenames:
        m = _OBJECT_RE.match(base)
        if m and int(m.group(2)) < total_heads:
            parts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), set()).add(m.group(3))
    out = {h: {head for head, found in heads.items() if want <= found}
           for h, heads in parts.items()}
    return {h: heads for h, heads in out.items() if heads}


def old_format_pages(basenames: Iterable[str]) -> dict[str, list[str]]:
    """Format-1 object basenames (`<hash>_<rank>_<size>_<k|v>`) grouped by page hash."""
    pages: dict[str, list[str]] = {}
    for base in basenames:
        m = _OLD_OBJECT_RE.match(base)
        if m:
            pages.setdefault(m.group(1), []).append(base)
    return pages


def same_model_namespace(name: str, namespace: KeyNamespace) -> bool:
    """Is folder `name` a namespace name of `namespace`'s model (any salt or fingerprint)?"""
    prefix = namespace.model.replace("/", "-") + "-"
    digest = name[len(prefix):]
    return name.startswith(prefix) and len(digest) == 16 and all(
        c in "0123456789abcdef" for c in digest)
