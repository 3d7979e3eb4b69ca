"""The L2 index of a vLLM engine: which page key is in which host-pool slot, on every rank.

A page key is the SHA-256 chain digest of a page-aligned token prefix (kvtier.keys), so a key
names its whole prefix and a dict over keys is a radix tree of pages: a prompt's hit is the run
of its keys found in order. The index lives on vLLM's scheduler side, the only place that sees
every request, and is the only owner of slot assignments; every rank's host pool holds the
same slots (a rank holds its own KV heads of each).

A slot is SAVING from the step that asked the ranks to copy a block into it until every rank
reported it saved, or FETCHING from the step that asked them to read it from L3 or a peer's L2
until every rank read it; then HELD. Only HELD pages are hits. A HELD page is evicted least
recently used first, and not while the ranks still write it to L3 (its `backing_up` votes are
short of the ranks): its slot's bytes are being read; nor while it is pinned (`pin`: a
request the scheduler pushed back will load it).

A fetch is a generation: every rank reports on each of its slots once, under the fetch's
ticket (kvtier.connector.plan.Ticket). A fetch any rank failed is a miss from that report on:
the key leaves the index (another fetch may bring the page into another slot), but the slot
stays reserved until every rank reported and no rank's storage or peer call may still write
it (`held_fetches` until `released`): a slot is never handed out while a rank writes into it.
A report on another generation than the slot's (a fetch that ended long ago) changes nothing.

The index also keeps what the router must learn (`take_changes`): a page becomes HELD, is
EVICTED from L2, or was STORED in L3 by every rank. Each change carries the page's
`PageOrigin` (its tokens, its parent's key, the request's salt), from which the router keys
it in its own key space (kvtier.vllm_engine.kv_events); the origin is kept only until the
page's last change that needs it.
"""
from __future__ import annotations

import enum
import itertools
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

from kvtier.connector.plan import Ticket
from kvtier.tiers.allocator import PageAllocator


class SlotState(enum.Enum):
    SAVING = "saving"  # the ranks were asked to copy a block in; not a hit yet
    FETCHING = "fetching"  # the ranks were asked to read it from L3; not a hit yet
    HELD = "held"  # every rank holds its part: a hit


class FetchSource(enum.Enum):
    """Where a FETCHING slot's page is read from."""

    L3 = "l3"
    PEER = "peer"  # another instance's L2


class FetchedPages(NamedTuple):
    """Of some slots loaded for a request: how many were read for it from L3, from a peer."""

    l3: int = 0
    peer: int = 0


class PageOrigin(NamedTuple):
    """What a page holds: its tokens, the key of the page before it (None: the prompt's
    first), the cache salt of the request that brought it; `by_tokens`: whether the tokens
    and the salt are all its key holds (False: a LoRA adapter, a multimodal item or prompt
    embeddings count too, which a subscriber that keys pages by their tokens cannot)."""

    tokens: tuple[int, ...]
    parent: str | None
    salt: str = ""
    by_tokens: bool = True


class L2ChangeKind(enum.Enum):
    HELD = "held"  # every rank holds it: a hit from now on
    EVICTED = "evicted"  # gone from L2
    STORED = "stored"  # every rank wrote its objects to L3


class L2Change(NamedTuple):
    kind: L2ChangeKind
    key: str
    origin: PageOrigin | None  # None for EVICTED, or a page reserved without one


class FetchOutcome(NamedTuple):
    """What the ranks' reports on fetches settled (`L2Index.fetched`)."""

    done: list[int]  # slots every rank read: HELD now
    failed: list[tuple[int, str]]  # (slot, key) of fetches that became misses now
    freed: list[int]  # failed slots every rank is done with: free again
    stale: int  # reports on another generation than the slot's: ignored


@dataclass
class _Entry:
    key: str
    state: SlotState
    origin: PageOrigin | None = None  # until its last HELD or STORED change
    votes: int = 0  # ranks that finished writing the slot to L3
    backing_up: bool = False  # the ranks write it to L3: not evictable until they all did
    store_failed: bool = False  # some rank failed to write it to L3: not published
    dropped: bool = False  # forgotten while backing up: freed once the writes ended
    source: FetchSource | None = None  # FETCHING: read from there; HELD: read from there
    fresh: bool = False  # HELD after a fetch and not loaded since: its first hit is source's
    gen: int = 0  # FETCHING: the fetch's generation
    read: int = 0  # FETCHING: ranks that read it
    unread: int = 0  # FETCHING: ranks that did not
    holds: int = 0  # FETCHING: ranks whose call may still write it
    missed: bool = False  # FETCHING: a rank did not read it; its key has left the index


class L2Index:
    """Page keys -> host-pool slots for one engine of `ranks` TP ranks."""

    def __init__(self, num_slots: int, ranks: int = 1) -> None:
        self._slots = PageAllocator(num_slots)
        self.ranks = ranks
        self._by_key: dict[str, int] = {}
        self._entries: dict[int, _Entry] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()  # evictable slots, least recent first
        self._changes: list[L2Change] = []
        self._gens = itertools.count(1)
        self._pins: Counter[int] = Counter()  # HELD slots not to evict (pin), by pin count
        self.quarantined = 0  # failed fetch slots some rank's call may still write

    def take_changes(self) -> list[L2Change]:
        """The pages that became HELD, were EVICTED or STORED since the last call, in order."""
        out, self._changes = self._changes, []
        return out

    def _announce(self, kind: L2ChangeKind, entry: _Entry, last: bool) -> None:
        self._changes.append(L2Change(kind, entry.key, entry.origin))
        if last:
            entry.origin = None

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def state(self, key: str) -> SlotState | None:
        slot = self._by_key.get(key)
        return None if slot is None else self._entries[slot].state

    def held_run(self, keys: Sequence[str]) -> list[int]:
        """The slots of the longest leading run of `keys` held in L2."""
        slots = []
        for key in keys:
            slot = self._by_key.get(key)
            if slot is None or self._entries[slot].state is not SlotState.HELD:
                break
            slots.append(slot)
        return slots

    def take_fetched(self, slots: Sequence[int]) -> FetchedPages:
        """How many of `slots` were read from L3 and from a peer and not loaded since (now
        they are)."""
        count = {FetchSource.L3: 0, FetchSource.PEER: 0}
        for slot in slots:
            entry = self._entries[slot]
            if entry.fresh and entry.source is not None:
                count[entry.source] += 1
            entry.fresh = False
        return FetchedPages(count[FetchSource.L3], count[FetchSource.PEER])

    def touch(self, slots: Sequence[int]) -> None:
        """Mark a prefix's slots used now; its deepest page becomes the first to go, so
        eviction trims prefixes from their ends and never orphans a longer run."""
        for slot in reversed(slots):
            if slot in self._lru:
                self._lru.move_to_end(slot)

    def pin(self, slots: Sequence[int]) -> None:
        """Keep HELD `slots` from eviction until as many `unpin`s (a request that will load
        them waits)."""
        self._pins.update(slot for slot in slots if slot in self._entries)

    def unpin(self, slots: Sequence[int]) -> None:
        for slot in slots:
            if self._pins[slot] <= 1:
                self._pins.pop(slot, None)
            else:
                self._pins[slot] -= 1

    def reserve(self, keys: Sequence[str], state: SlotState = SlotState.SAVING,
                origins: Sequence[PageOrigin] | None = None,
                source: FetchSource | None = None) -> list[int]:
        """A slot in `state` (SAVING, or FETCHING from `source`) for each key not already
        indexed, in order, evicting as needed; stops early when nothing more can be evicted.
        Returns the slots taken, one per key from the first, so the caller moves that many
        leading keys. `origins`: each key's page, for the changes the router learns. The
        slots of one FETCHING reservation share a generation (`generation`)."""
        if (state is SlotState.FETCHING) != (source is not None):
            raise ValueError("a FETCHING slot needs the source it is read from, and only it")
        gen = next(self._gens) if state is SlotState.FETCHING else 0
        taken: list[int] = []
        for i, key in enumerate(keys):
            if key in self._by_key:
                raise ValueError(f"page {key[:12]} is already in L2: reserve only new pages")
            slot = self._take_slot()
            if slot is None:
                break
            self._by_key[key] = slot
            self._entries[slot] = _Entry(key, state, origins[i] if origins else None,
                                         source=source, gen=gen)
            taken.append(slot)
        return taken

    def generation(self, slot: int) -> int:
        """The generation of the fetch that reserved FETCHING `slot`."""
        return self._entries[slot].gen

    def settle(self, saved: Iterable[int], failed: Iterable[int],
               backing_up: bool = False) -> list[tuple[str, int]]:
        """The ranks' word on SAVING slots: saved ones become HELD (`backing_up`: the ranks
        write them to L3 next, so they stay until `stored` counts every rank), failed ones
        are freed. Returns (key, slot) of the slots that became HELD."""
        held = []
        for slot in saved:
            entry = self._entries.get(slot)
            if entry is not None and entry.state is SlotState.SAVING:
                entry.state, entry.backing_up, entry.votes = SlotState.HELD, backing_up, 0
                held.append((entry.key, slot))
                self._announce(L2ChangeKind.HELD, entry, last=not backing_up)
                if not backing_up:
                    self._lru[slot] = None
        self._free_failed(failed, SlotState.SAVING)
        return held

    def stored(self, slots: Iterable[int], failed: Iterable[int] = ()) -> None:
        """One vote per rank that finished writing a slot to L3 (or gave up: also in
        `failed`): once every rank did, the slot may be evicted, and unless one failed the
        page is STORED."""
        for slot in failed:
            entry = self._entries.get(slot)
            if entry is not None and entry.backing_up:
                entry.store_failed = True
        for slot in slots:
            entry = self._entries.get(slot)
            if entry is None or not entry.backing_up or not self._vote(entry):
                continue
            entry.backing_up = False
            if not entry.store_failed:
                self._announce(L2ChangeKind.STORED, entry, last=True)
            entry.origin = None
            if entry.dropped:
                self._entries.pop(slot)
                self._slots.free([slot])
            else:
                self._lru[slot] = None

    def fetched(self, read: Iterable[Ticket], unread: Iterable[Ticket] = (),
                held: Iterable[Ticket] = (), released: Iterable[Ticket] = ()) -> FetchOutcome:
        """The ranks' reports on fetches, one per rank and ticket (module docstring): `read`,
        `unread`, `held` (unread, and the rank's call may still write the slot) and
        `released` (a held slot's call returned)."""
        out = FetchOutcome([], [], [], 0)
        touched: dict[int, _Entry] = {}
        for tickets, read_it, holds in ((read, True, 0), (unread, False, 0),
                                        (held, False, 1), (released, None, -1)):
            for slot, gen in tickets:
                entry = self._entries.get(slot)
                if entry is None or entry.state is not SlotState.FETCHING or entry.gen != gen:
                    out = out._replace(stale=out.stale + 1)
                    continue
                if read_it is True:
                    entry.read += 1
                elif read_it is False:
                    entry.unread += 1
                entry.holds += holds
                self.quarantined += holds
                touched[slot] = entry
        for slot, entry in touched.items():
            if entry.unread and not entry.missed:  # a miss from now on
                entry.missed = True
                if self._by_key.get(entry.key) == slot:
                    del self._by_key[entry.key]
                out.failed.append((slot, entry.key))
            if entry.read + entry.unread < self.ranks or entry.holds > 0:
                continue  # a rank is still reading, or a call may still write the slot
            if entry.unread:
                self._entries.pop(slot)
                self._slots.free([slot])
                out.freed.append(slot)
            else:
                entry.state, entry.fresh = SlotState.HELD, True
                self._lru[slot] = None
                out.done.append(slot)
                self._announce(L2ChangeKind.HELD, entry, last=True)
        return out

    def drop_slots(self, slots: Iterable[int]) -> int:
        """Forget HELD pages (a load from them failed on some rank); returns how many. One
        still being written to L3 goes once the writes ended."""
        dropped = 0
        for slot in set(slots):
            entry = self._entries.get(slot)
            if entry is None or entry.state is not SlotState.HELD or entry.dropped:
                continue
            if entry.backing_up:  # its bytes are being written: the key goes, the slot waits
                del self._by_key[entry.key]
                entry.dropped = True
                self._changes.append(L2Change(L2ChangeKind.EVICTED, entry.key, None))
            else:
                self._drop(slot)
            dropped += 1
        return dropped

    def _vote(self, entry: _Entry) -> bool:
        entry.votes += 1
        if entry.votes < self.ranks:
            return False
        entry.votes = 0
        return True

    def _free_failed(self, slots: Iterable[int], state: SlotState) -> None:
        for slot in slots:
            entry = self._entries.get(slot)
            if entry is not None and entry.state is state:
                self._drop(slot)

    def _take_slot(self) -> int | None:
        got = self._slots.alloc(1)
        if got is None:
            victim = next((slot for slot in self._lru if slot not in self._pins), None)
            if victim is not None:
                self._drop(victim)
                got = self._slots.alloc(1)
        return None if got is None else got[0]

    def _drop(self, slot: int) -> None:
        entry = self._entries.pop(slot)
        del self._by_key[entry.key]
        if entry.state is SlotState.HELD:  # the router knew it
            self._changes.append(L2Change(L2ChangeKind.EVICTED, entry.key, None))
        self._lru.pop(slot, None)
        self._pins.pop(slot, None)
        self._slots.free([slot])
