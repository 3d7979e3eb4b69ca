"""Pinned prefixes of one rank's cache: kept in L2 for a TTL whatever the load.

A pin names the whole pages of a prefix (under a cache salt). Pinning gives every run of it an
L2 copy (L1-only runs are copied first) and marks the path (`HiRadixTree.pin`), so L2
eviction skips those pages; L1 eviction may still demote them to L2. Each pin expires
`ttl_s` after it was made or after the last lookup that matched any of its pages.

Pinned pages may take at most `max_fraction` of the L2 pool: a pin past that is refused with
the room it needs and the room there is (`PinRefusal`), never by evicting another pin.

Why its own class: the tree keeps only a count per node (`pin_ref`); which pins exist, their
TTLs and their budget live here, owned by the cache facade. Plain Python; the clock is
injectable so tests can move time.

TP ranks: every rank of an instance gets the same pin calls (the instance pins the MIN of
the pages they hold) and the same lookups, so their pins match; each expires them on its own
clock between steps, so ranks may drop one a step apart. A page one rank evicts meanwhile is
what the ranks' MIN agreement already covers: a shorter agreed hit, never a wrong one.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Sequence

from kvtier.errors import CacheUsageError
from kvtier.tiers.page_pins import check_ttl
from kvtier.tiers.radix_tree import HiRadixTree
from kvtier.tiers.sidecar import Sidecar
from kvtier.tiers.tree_node import TreeNode, as_key

MAX_PINS = 1024  # per rank: pins are paid prefixes, not a cache of their own


@dataclass
class TreePin:
    pin_id: str
    salt: str
    tenant: str  # the label the pin was made with (shown in listings)
    node: TreeNode  # ends the pinned prefix (a split keeps the deeper part, so this node)
    pages: int
    ttl_s: float
    expires_at: float
    window: list[int] = field(default_factory=list)  # L2 pages whose sliding KV it holds


class PinRefusal(NamedTuple):
    """Why a pin was not made: `needed_pages` more L2 pages than the `free_pages` pins may
    still take (or than L2 could copy)."""

    needed_pages: int
    free_pages: int
    reason: str


class PinListing(NamedTuple):
    """One pin of a rank's cache, as /admin/pins lists it: where its pages are now."""

    pin_id: str
    tenant: str
    pages: int
    expires_in_s: float  # 0 once lapsed (dropped by the next `expire`)
    device_pages: int    # of its path's pages, those in L1
    host_pages: int      # and in L2


class PinOutcome(NamedTuple):
    """A pin made (or refreshed): its pages and where they are now."""

    pin_id: str
    pages: int
    device_pages: int
    host_pages: int
    expires_in_s: float


def _path(node: TreeNode) -> list[TreeNode]:
    """Root side first."""
    return list(node.path_to_root())[::-1]


class CachePins:
    """The pins of one cache (see the module docstring)."""

    def __init__(self, tree: HiRadixTree, host_pages: int,
                 copy_to_host: Callable[[TreeNode], bool], settle: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic,
                 sidecar: Sidecar | None = None, window_pages: int = 0) -> None:
        """`sidecar`, `window_pages`: a hybrid model's L2 sidecar, whose slots of the last
        `window_pages` pages of a pinned prefix (what a hit ending there needs of the sliding
        layers) the pin keeps too."""
        self.tree, self.host_pages = tree, host_pages
        self.sidecar, self.window_pages = sidecar, window_pages
        self._copy_to_host, self._settle = copy_to_host, settle  # start L1->L2; land copies
        self.clock = clock
        self._pins: dict[str, TreePin] = {}
        self._by_node: dict[int, set[str]] = {}  # end node id -> pins ending there
        self._soonest = float("inf")  # no pin expires before this
        self._refreshed: set[str] = set()  # pins a hit extended since take_refreshed()
        self.expired_total = 0

    def __len__(self) -> int:
        return len(self._pins)

    # ---- queries ---------------------------------------------------------------------------
    def held_pages(self, tokens: Sequence[int], salt: str = "") -> int:
        """Whole pages of `tokens` this cache holds in L1 or L2 (what it could pin)."""
        m = self.tree.match_prefix(tokens, touch=False, salt=salt)
        return m.hit_length // self.tree.page_size

    def pinned_nodes(self) -> dict[int, TreeNode]:
        """Every node some pin runs through, by id."""
        out: dict[int, TreeNode] = {}
        for pin in self._pins.values():
            for n in pin.node.path_to_root():
                if n.id in out:
                    break  # the rest of the path is in already
                out[n.id] = n
        return out

    def pinned_pages(self) -> tuple[int, int, int]:
        """(distinct pinned pages, of which in L1, of which in L2)."""
        nodes = self.pinned_nodes().values()
        return (sum(n.num_pages for n in nodes),
                sum(len(n.value) for n in nodes if n.value is not None),
                sum(len(n.host_value) for n in nodes if n.host_value is not None))

    def limit_pages(self, max_fraction: float) -> int:
        return int(max_fraction * self.host_pages)

    def describe(self) -> list[PinListing]:
        now = self.clock()
        return [PinListing(p.pin_id, p.tenant, p.pages, round(max(0.0, p.expires_at - now), 3),
                           sum(len(n.value) for n in p.node.path_to_root()
                               if n.value is not None),
                           sum(len(n.host_value) for n in p.node.path_to_root()
                               if n.host_value is not None))
                for p in self._pins.values()]

    # ---- pin / unpin -----------------------------------------------------------------------
    def pin(self, pin_id: str, tokens: Sequence[int], pages: int, ttl_s: float,
            max_fraction: float, salt: str = "", tenant: str = "") -> PinOutcome | PinRefusal:
        """Pin the first `pages` whole pages of `tokens` (they must be held: `held_pages`)
        for `ttl_s`; pinning `pin_id` again refreshes it (or moves it to these pages)."""
        check_ttl(ttl_s)
        p = self.tree.page_size
        key = as_key(tokens)[: pages * p]
        if pages < 1 or len(key) < pages * p:
            raise CacheUsageError(f"a pin covers at least one whole page; {len(key)} tokens "
                                  f"cannot give {pages} pages of {p}")
        m = self.tree.match_prefix(key, touch=False, salt=salt)
        if m.hit_length < pages * p:
            raise CacheUsageError(f"pin {pin_id}: this cache holds {m.hit_length // p} of "
                                  f"the {pages} pages; pin only what held_pages says")
        end = max(m.last_device_node, m.last_host_node, key=lambda n: len(_path(n)))
        old = self._pins.get(pin_id)
        if old is not None and old.node is end:
            return self._keep(old, ttl_s)
        if old is None and len(self._pins) >= MAX_PINS:
            return PinRefusal(pages, 0, f"at most {MAX_PINS} pins per rank")
        if old is not None:
            self._drop(old)
        refused = self._make_room(end, max_fraction)
        if refused is not None:
            if old is not None:
                self._add(old)
            return refused
        return self._keep(self._add(TreePin(pin_id, salt, tenant, end, pages, ttl_s, 0.0)),
                          ttl_s)

    def _make_room(self, end: TreeNode, max_fraction: float) -> PinRefusal | None:
        """Check the pin budget and give every run of the path an L2 copy (None: done)."""
        path = _path(end)
        needed = sum(n.num_pages for n in path if not n.pin_ref)
        free = self.limit_pages(max_fraction) - self.pinned_pages()[0]
        if needed > free:
            return PinRefusal(needed, max(0, free), "pinned pages are over their share of L2")
        copies = [n for n in path if n.host_value is None]
        self.tree.protect_host(end)  # making L2 room for the copies must not take the path
        try:
            copied = all(self._copy_to_host(n) for n in copies)  # root side first
            if copies:
                self._settle()  # the copies land (a failed one leaves its run in L1 only)
        finally:
            self.tree.release_host(end)
        if not copied:
            return PinRefusal(sum(n.num_pages for n in copies), 0,
                              "L2 has no room to copy the prefix from L1 (everything else "
                              "in it is pinned or in use)")
        if any(n.host_value is None for n in path):
            return PinRefusal(needed, free, "copying the prefix from L1 to L2 failed")
        return None

    def unpin(self, pin_id: str) -> bool:
        """Drop a pin; False when there is none by that id (expired, never made)."""
        pin = self._pins.get(pin_id)
        if pin is None:
            return False
        self._drop(pin)
        return True

    def expire(self) -> list[str]:
        """Drop the pins whose TTL ran out; their ids (cheap when none is due)."""
        now = self.clock()
        if now < self._soonest:
            return []
        gone = [p for p in self._pins.values() if p.expires_at <= now]
        for pin in gone:
            self._drop(pin)
        self.expired_total += len(gone)
        self._soonest = min((p.expires_at for p in self._pins.values()), default=float("inf"))
        return [p.pin_id for p in gone]

    # ---- hits ------------------------------------------------------------------------------
    def on_hit(self, node: TreeNode) -> None:
        """A lookup matched the prefix ending at `node`: every pin with a page in it lives
        another TTL from now."""
        if not self._pins or node.parent is None:
            return
        path = _path(node)
        if not path[0].pin_ref:  # every pin through this path runs through its first node
            return
        ids: set[str] = set()
        for n in path:
            ids |= self._by_node.get(n.id, set())
        stack = [c for c in node.children.values() if c.pin_ref]
        while stack:  # pins ending below: the hit used their leading pages
            n = stack.pop()
            ids |= self._by_node.get(n.id, set())
            stack.extend(c for c in n.children.values() if c.pin_ref)
        now = self.clock()
        for pin_id in ids:
            pin = self._pins[pin_id]
            pin.expires_at = now + pin.ttl_s
        self._refreshed |= ids

    def take_refreshed(self) -> list[str]:
        """Pins a hit extended since the last call (to extend their L3 pins too)."""
        out, self._refreshed = sorted(self._refreshed), set()
        return out

    # ---- internals -------------------------------------------------------------------------
    def _keep(self, pin: TreePin, ttl_s: float) -> PinOutcome:
        pin.ttl_s = ttl_s
        pin.expires_at = self.clock() + ttl_s
        self._soonest = min(self._soonest, pin.expires_at)
        path = _path(pin.node)
        return PinOutcome(pin.pin_id, pin.pages,
                          sum(len(n.value) for n in path if n.value is not None),
                          sum(len(n.host_value) for n in path if n.host_value is not None),
                          ttl_s)

    def _add(self, pin: TreePin) -> TreePin:
        self.tree.pin(pin.node)
        if self.sidecar is not None:
            host = [p for n in _path(pin.node) for p in n.host_value or ()]
            pin.window = self.sidecar.lock(host[max(0, len(host) - self.window_pages):])
        self._pins[pin.pin_id] = pin
        self._by_node.setdefault(pin.node.id, set()).add(pin.pin_id)
        self._soonest = min(self._soonest, pin.expires_at)
        return pin

    def _drop(self, pin: TreePin) -> None:
        del self._pins[pin.pin_id]
        ids = self._by_node[pin.node.id]
        ids.discard(pin.pin_id)
        if not ids:
            del self._by_node[pin.node.id]
        self.tree.unpin(pin.node)
        if self.sidecar is not None:
            self.sidecar.unlock(pin.window)
