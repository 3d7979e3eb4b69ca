"""Peer-to-peer L2, the lookup: each lending TP rank publishes, in memory its transport
endpoint has registered, a table of what its L2 pages hold, and a reader reads that table
with a one-sided READ before it reads the pages. Nothing on the holder answers a peer: a
holder busy in a long step is read as fast as an idle one.

The table has one row per L2 page of the holder rank (row i describes L2 page i):

  key     the first KEY_BYTES bytes of the page's chain key (kvtier.keys: the namespace's
          SHA-256 chain over the prefix's pages, under the request's salt; the same for
          every TP size by default), all zero when the page holds nothing published
  sums    one xxh3_64 per KV head of the rank's pool: the head's K then V object of the page
  check   a checksum of the row's other words (`row_checks`): a row read while its owner
          rewrites it does not match its check and is read as empty

The owner (the cache's thread: tiers/hierarchical_cache.py) publishes a page's row once its
L2 copy has landed, the sums taken from the landed bytes, and clears the row when the page
is freed, before it can be reused. A reader that read a row before it was
cleared reads the page's new bytes under the old sums: they do not match, and the read ends
before that page (tiers/peer_pages.py verifies every page it keeps). So a row may be stale
but never names bytes it was not summed from.

The sums cost a pass over the bytes (on this machine about as long as a third of copying
them: docs/benchmarks.md). A page a peer read filled was already summed by the read's check,
so the reader leaves its sums in the pool owner's `VerifiedSums` and the owner lists the
page with them instead of summing it again.
"""
from __future__ import annotations

import threading
from typing import Callable, NamedTuple, Sequence

import numpy as np

KEY_BYTES = 16
_CHECK_SEED = np.uint64(0x9E3779B97F4A7C15)  # an all-zero row is not a valid row
_MIX = np.uint64(0xBF58476D1CE4E5B9)


def row_dtype(heads: int) -> np.dtype:
    """A table row of a rank whose pool holds `heads` KV heads."""
    return np.dtype([("key", f"V{KEY_BYTES}"), ("sums", "<u8", (heads,)), ("check", "<u8")])


def row_checks(rows: np.ndarray) -> np.ndarray:
    """Each row's check: its words before `check`, each times a distinct odd multiplier,
    summed (mod 2**64), plus a seed."""
    words = rows.view(np.uint64).reshape(len(rows), rows.dtype.itemsize // 8)[:, :-1]
    weights = (np.arange(1, words.shape[1] + 1, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
               ) * _MIX
    return (words * weights).sum(axis=1, dtype=np.uint64) + _CHECK_SEED


def key_bytes(key: str) -> bytes:
    """A chain key (hex) as a table row holds it."""
    return bytes.fromhex(key)[:KEY_BYTES]


class TableHit(NamedTuple):
    """The leading run of a prefix's pages a table lists: their L2 page ids, and their sums
    (page by page, then head of the holder's pool)."""

    pages: tuple[int, ...]
    sums: tuple[int, ...]


class PeerTable:
    """One lending rank's table: a row per L2 page (the module docstring). Written by the
    cache's owner thread only; read by peers at any time."""

    def __init__(self, num_pages: int, heads: int) -> None:
        self.heads = heads
        self.rows = np.zeros(num_pages, row_dtype(heads))  # all zero: no row valid yet

    @property
    def addr(self) -> int:
        return int(self.rows.ctypes.data)

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes)

    @property
    def num_pages(self) -> int:
        return len(self.rows)

    def publish(self, pages: Sequence[int], keys: Sequence[str], sums: Sequence[int]) -> None:
        """Page `pages[i]` holds the page keyed `keys[i]`; `sums` per page then head."""
        if not len(pages) == len(keys) == len(sums) // max(self.heads, 1):
            raise ValueError(f"{len(pages)} pages, {len(keys)} keys and {len(sums)} sums "
                             f"for {self.heads} heads do not match")
        if not pages:
            return
        idx = np.asarray(pages, dtype=np.int64)
        fresh = np.zeros(len(idx), self.rows.dtype)
        fresh["key"] = [key_bytes(k) for k in keys]
        fresh["sums"] = np.asarray(sums, dtype=np.uint64).reshape(len(idx), self.heads)
        fresh["check"] = row_checks(fresh)
        self.rows[idx] = fresh

    def clear(self, pages: Sequence[int]) -> None:
        """Pages `pages` hold nothing published any more."""
        if len(pages):
            words = self.rows.view(np.uint64).reshape(len(self.rows), -1)
            words[np.asarray(pages, dtype=np.int64)] = 0


class VerifiedSums:
    """Head sums of pool pages that a verified peer read filled, for the pool's owner to
    list the pages with (`sums`) instead of summing their bytes again. The reader `put`s
    them from its thread once the read's check passed; the owner takes them when it lists
    the pages and `drop`s them whenever a page is freed or about to be rewritten, so an entry
    never outlives the bytes it was taken from."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[int, tuple[int, ...]] = {}

    def __len__(self) -> int:
        return len(self._sums)

    def put(self, pages: Sequence[int], sums: Sequence[int], heads: int) -> None:
        """Pages `pages` hold bytes whose sums are `sums` (page by page, then each of the
        pool's `heads` heads in order)."""
        if len(sums) != len(pages) * heads:
            raise ValueError(f"{len(sums)} sums for {len(pages)} pages of {heads} heads")
        rows = {int(p): tuple(int(x) for x in sums[i * heads:(i + 1) * heads])
                for i, p in enumerate(pages)}
        with self._lock:
            self._sums.update(rows)

    def drop(self, pages: Sequence[int]) -> None:
        """Pages `pages` are freed or about to be rewritten: forget their sums."""
        if not self._sums:  # nothing kept (the common case): no lock taken; a put names
            return  # only pages its reader holds, never pages being freed
        with self._lock:
            for p in pages:
                self._sums.pop(int(p), None)

    def sums(self, pages: Sequence[int], heads: int,
             compute: Callable[[list[int]], Sequence[int]]) -> tuple[int, ...]:
        """The sums of `pages` (page by page, then head) to list them with: those a verified
        read left (taken: each is used once), `compute(pages)` of the others."""
        if not self._sums:  # nothing kept: every page summed (see drop)
            return tuple(compute([int(p) for p in pages]))
        with self._lock:
            known = [self._sums.pop(int(p), None) for p in pages]
        missing = [int(p) for p, k in zip(pages, known) if k is None]
        computed = iter(compute(missing) if missing else ())
        out: list[int] = []
        for k in known:
            out.extend(k if k is not None else (next(computed) for _ in range(heads)))
        return tuple(out)


def lookup(raw: np.ndarray, heads: int, keys: Sequence[str]) -> TableHit:
    """The leading run of `keys` (chain keys, in prefix order) a table read as `raw` bytes
    lists in valid rows (a holder whose pool holds `heads` heads)."""
    rows = raw.view(row_dtype(heads))
    if not len(keys):
        return TableHit((), ())
    words = rows.view(np.uint64).reshape(len(rows), rows.dtype.itemsize // 8)
    # each key as its two words: the first finds candidate rows, both must match
    wanted = np.frombuffer(b"".join(key_bytes(k) for k in keys), np.uint64).reshape(
        -1, KEY_BYTES // 8)
    firsts = np.sort(wanted[:, 0])
    at = np.minimum(np.searchsorted(firsts, words[:, 0]), len(firsts) - 1)
    candidates = np.flatnonzero(firsts[at] == words[:, 0])  # rows a key may be in: few
    candidates = candidates[rows["check"][candidates] == row_checks(rows[candidates])]
    where = {(int(words[i, 0]), int(words[i, 1])): int(i) for i in candidates}
    pages: list[int] = []
    sums: list[int] = []
    for first, second in wanted.tolist():
        page = where.get((first, second))
        if page is None:
            break
        pages.append(page)
        sums.extend(int(s) for s in rows["sums"][page])
    return TableHit(tuple(pages), tuple(sums))
