"""The tier-aware router's data side: an approximate prefix index per instance, and a choice.

Instances push `CacheEventBatch`es (`kvtier.frontend.cache_events`); `PrefixIndex` keeps, per
instance, where each page it was told about is (L1 and/or L2), plus ONE set of pages in L3,
because L3 is shared by every instance of a namespace (one index serves one namespace: the
page hashes of two namespaces never meet). `Router.choose` turns that into an instance for a
request: the expected prefill cost per instance (what it still has to compute or load, by
tier) plus a penalty for its queue, with power-of-two-choices on load when nothing tells the
instances apart.

Why approximate is fine: a wrong guess costs a recompute on the chosen instance, never a
wrong answer (the instance's own cache decides what it really hits). So the index drops old
entries under a memory cap and keeps going after a missed batch (it flags the instance).
Pure logic: no Ray, no clock; the serve graph calls it.
"""
from __future__ import annotations

import enum
import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from kvtier.errors import ConfigError
from kvtier.frontend.cache_events import CacheEvent, CacheEventBatch, CacheEventKind, CacheTier
from kvtier.messages import MAX_HASHES

DEFAULT_MAX_PAGES_PER_INSTANCE = 1 << 20  # ~1M pages x ~150 B: about 150 MiB per instance
DEFAULT_MAX_STORAGE_PAGES = 1 << 22
_DEVICE, _HOST = 1, 2  # bits of a page's entry in an instance's map


class TierHits(NamedTuple):
    """Leading pages of a request an instance holds, each counted in its best tier."""

    device_pages: int
    host_pages: int
    storage_pages: int
    peer_pages: int = 0  # in another instance's L2 only (peer-to-peer L2 reads them)

    @property
    def total_pages(self) -> int:
        return self.device_pages + self.host_pages + self.storage_pages + self.peer_pages

    @property
    def local_pages(self) -> int:
        """Pages in the instance's own L1/L2 (L3 pages every instance of the namespace has)."""
        return self.device_pages + self.host_pages


class ApplyOutcome(enum.Enum):
    APPLIED = "applied"
    GAP = "gap"  # applied, but batches before it were missed: the instance's index is stale
    IGNORED = "ignored"  # seq not newer than the last one applied (duplicate, out of order)


@dataclass
class _InstanceIndex:
    pages: "OrderedDict[str, int]"  # page hash -> _DEVICE | _HOST bits, least recent first
    last_seq: int = 0
    stale: bool = False


class PrefixIndex:
    """Per instance: page hash -> L1/L2 bits, LRU-capped; shared: pages in L3, LRU-capped."""

    def __init__(self, max_pages_per_instance: int = DEFAULT_MAX_PAGES_PER_INSTANCE,
                 max_storage_pages: int = DEFAULT_MAX_STORAGE_PAGES) -> None:
        if max_pages_per_instance < 1 or max_storage_pages < 1:
            raise ConfigError("PrefixIndex caps must be >= 1 page, got "
                              f"{max_pages_per_instance} and {max_storage_pages}")
        self.max_pages_per_instance = max_pages_per_instance
        self.max_storage_pages = max_storage_pages
        self._instances: dict[str, _InstanceIndex] = {}
        self._storage: OrderedDict[str, None] = OrderedDict()
        self.dropped_pages = 0  # entries dropped by the caps (a later request may miss them)

    # ---- updates --------------------------------------------------------------------------
    def apply(self, batch: CacheEventBatch) -> ApplyOutcome:
        """Apply one instance's batch, unless it is not newer than what was applied."""
        inst = self._instances.get(batch.instance)
        if inst is None:
            inst = self._instances[batch.instance] = _InstanceIndex(OrderedDict())
        if batch.seq <= inst.last_seq:
            return ApplyOutcome.IGNORED
        gap = batch.seq != inst.last_seq + 1
        inst.last_seq = batch.seq
        inst.stale = inst.stale or gap
        self._apply_events(inst, batch.events)
        return ApplyOutcome.GAP if gap else ApplyOutcome.APPLIED

    def _apply_events(self, inst: _InstanceIndex, events: Sequence[CacheEvent]) -> None:
        for event in events:
            if event.tier is CacheTier.STORAGE:
                self._apply_storage(event)
            else:
                self._apply_local(inst, event)
        self._trim(inst.pages, self.max_pages_per_instance)
        self._trim(self._storage, self.max_storage_pages)

    def _apply_local(self, inst: _InstanceIndex, event: CacheEvent) -> None:
        pages, kind = inst.pages, event.kind
        bit = _DEVICE if event.tier is CacheTier.DEVICE else _HOST
        for h in event.page_hashes:
            old = pages.pop(h, 0)
            if kind is CacheEventKind.STORED:
                new = old | bit
            elif kind is CacheEventKind.DEMOTED:
                new = (old & ~_DEVICE) | _HOST
            else:
                new = old & ~bit
            if new:
                pages[h] = new  # at the end: most recently changed

    def _apply_storage(self, event: CacheEvent) -> None:
        for h in event.page_hashes:
            self._storage.pop(h, None)
            if event.kind is CacheEventKind.STORED:
                self._storage[h] = None

    def _trim(self, pages: OrderedDict, cap: int) -> None:
        while len(pages) > cap:
            pages.popitem(last=False)
            self.dropped_pages += 1

    def assume(self, instance: str, page_hashes: Sequence[str]) -> None:
        """`instance` was just given a request over these pages: count them in its L1 now.

        Why: events arrive a poll later, and a conversation's next turn often comes sooner;
        without this it would be routed as if its prefix were nowhere. Events correct the
        guess (an eviction, or a prefix that did not fit, removes it)."""
        inst = self._instances.get(instance)
        if inst is None:
            inst = self._instances[instance] = _InstanceIndex(OrderedDict())
        for h in page_hashes:
            inst.pages[h] = inst.pages.pop(h, 0) | _DEVICE
        self._trim(inst.pages, self.max_pages_per_instance)

    def forget(self, instance: str) -> None:
        """Drop an instance (gone, or restarted: its seq starts again at 1, its pages are gone)."""
        self._instances.pop(instance, None)

    def holdings(self, instance: str) -> CacheEventBatch | None:
        """What the index knows `instance` holds, as one batch at its last seq: its L1 and L2
        pages and the L3 pages it was told of, STORED (`restore` rebuilds another index's
        entries from it); None before its first batch. An instance's server keeps an index
        of its own events for this: a router that starts again asks for it."""
        inst = self._instances.get(instance)
        if inst is None or inst.last_seq == 0:
            return None
        runs = [(CacheTier.DEVICE, [h for h, bits in inst.pages.items() if bits & _DEVICE]),
                (CacheTier.HOST, [h for h, bits in inst.pages.items() if bits & _HOST]),
                (CacheTier.STORAGE, list(self._storage))]
        events = tuple(CacheEvent(CacheEventKind.STORED, tier, tuple(pages[i:i + MAX_HASHES]))
                       for tier, pages in runs for i in range(0, len(pages), MAX_HASHES))
        return CacheEventBatch(instance, inst.last_seq, events)

    def restore(self, batch: CacheEventBatch) -> None:
        """Replace `batch.instance`'s entries by the holdings in `batch` (`holdings`): no
        longer stale, at its seq, so the batches after it apply in order."""
        self.forget(batch.instance)
        inst = self._instances[batch.instance] = _InstanceIndex(OrderedDict(), batch.seq)
        self._apply_events(inst, batch.events)

    # ---- queries --------------------------------------------------------------------------
    def instances(self) -> list[str]:
        return list(self._instances)

    def is_stale(self, instance: str) -> bool:
        """True once a batch of `instance` was missed: its entries may be wrong until forgotten."""
        inst = self._instances.get(instance)
        return inst is not None and inst.stale

    def num_pages(self, instance: str) -> int:
        inst = self._instances.get(instance)
        return 0 if inst is None else len(inst.pages)

    @property
    def num_storage_pages(self) -> int:
        return len(self._storage)

    def score(self, instance: str, page_hashes: Sequence[str], peers: bool = False
              ) -> TierHits:
        """The longest prefix of `page_hashes` that `instance` can hit, split by best tier.
        `peers`: a page another instance holds in L2 is a hit too (peer-to-peer L2)."""
        inst = self._instances.get(instance)
        pages = inst.pages if inst is not None else {}
        others = [i.pages for name, i in self._instances.items() if name != instance] \
            if peers else []
        storage = self._storage
        counts = [0, 0, 0, 0]
        for h in page_hashes:
            bits = pages.get(h, 0)
            if bits & _DEVICE:
                counts[0] += 1
            elif bits & _HOST:
                counts[1] += 1
            elif h in storage:
                counts[2] += 1
            elif any(other.get(h, 0) & _HOST for other in others):
                counts[3] += 1
            else:
                break  # the prefix ends at the first page no tier holds
        return TierHits(*counts)


@dataclass(frozen=True)
class RouteWeights:
    """Expected cost of a request on an instance, in "pages prefilled from scratch".

    Why these defaults: an L1 hit is read in place (free); an L2 hit is a host-to-device copy,
    far cheaper than recomputing attention and MLP for the page; an L3 hit adds a storage read
    before that copy, a peer hit a read of another instance's L2 (an ask and a transfer:
    priced between the two, it may be as fast as local storage or slower); a miss is the full
    prefill. A request queued ahead on the instance
    delays ours about as much as computing `per_queued_request` pages (it shares the step
    budget under chunked prefill). Costs within `tie_margin_pages` of the best are a tie,
    broken by power-of-two-choices on load. Tune per model and hardware.
    """

    device: float = 0.0
    host: float = 0.2
    storage: float = 0.5
    peer: float = 0.5
    miss: float = 1.0
    per_queued_request: float = 2.0
    tie_margin_pages: float = 0.5

    def __post_init__(self) -> None:
        for name in ("device", "host", "storage", "peer", "miss", "per_queued_request",
                     "tie_margin_pages"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value < float("inf"):
                raise ConfigError(f"RouteWeights.{name} must be a finite number >= 0, got {value!r}")
        if not self.device <= self.host <= self.storage <= self.miss:
            raise ConfigError("RouteWeights must satisfy device <= host <= storage <= miss "
                              f"(a faster tier never costs more), got {self.device}, {self.host}, "
                              f"{self.storage}, {self.miss}")
        if not self.host <= self.peer <= self.miss:
            raise ConfigError("RouteWeights must satisfy host <= peer <= miss (another "
                              f"instance's L2 is read into this one's), got {self.host}, "
                              f"{self.peer}, {self.miss}")

    def cost(self, hits: TierHits, num_pages: int, load: int) -> float:
        misses = max(0, num_pages - hits.total_pages)
        return (self.device * hits.device_pages + self.host * hits.host_pages
                + self.storage * hits.storage_pages + self.peer * hits.peer_pages
                + self.miss * misses
                + self.per_queued_request * load)


class ChoiceReason(enum.Enum):
    BEST_HIT = "best_hit"  # the cheapest expected prefill plus queue, by a margin
    TIE = "tie"  # several within the margin: power-of-two-choices on load among them
    NO_LOCAL_HIT = "no_local_hit"  # no instance holds a page in L1/L2: two choices on load


class Choice(NamedTuple):
    instance: str
    reason: ChoiceReason
    hits: TierHits  # what the index expects the chosen instance to hit
    cost: float


class Router:
    """Chooses an instance for a request from the index, the weights and the instances' loads.

    Why power-of-two-choices and not the least loaded: loads reach the router late and
    several routers may choose at once; sending everything to the one that looked idlest
    herds, two random candidates spread it (and still avoid the loaded ones).
    """

    def __init__(self, index: PrefixIndex | None = None, weights: RouteWeights | None = None,
                 peers: bool = False) -> None:
        """`peers`: the instances read each other's L2 (a page one holds there is a hit for
        every other, at `weights.peer`)."""
        self.index = index if index is not None else PrefixIndex()
        self.weights = weights if weights is not None else RouteWeights()
        self.peers = peers

    def apply(self, batch: CacheEventBatch) -> ApplyOutcome:
        return self.index.apply(batch)

    def choose(self, page_hashes: Sequence[str], loads: Mapping[str, int],
               rng: random.Random) -> Choice:
        """Pick one of `loads`' instances (queued requests each) for a request's page hashes."""
        if not loads:
            raise ConfigError("Router.choose needs at least one instance in `loads`")
        n = len(page_hashes)
        hits = {name: self.index.score(name, page_hashes, self.peers) for name in loads}
        costs = {name: self.weights.cost(hits[name], n, loads[name]) for name in loads}
        if not any(h.local_pages for h in hits.values()):
            name, reason = _two_choices(list(loads), loads, rng), ChoiceReason.NO_LOCAL_HIT
        else:
            best = min(costs.values())
            near = [name for name in loads if costs[name] <= best + self.weights.tie_margin_pages]
            if len(near) == 1:
                name, reason = near[0], ChoiceReason.BEST_HIT
            else:
                name, reason = _two_choices(near, loads, rng), ChoiceReason.TIE
        self.index.assume(name, page_hashes)
        return Choice(name, reason, hits[name], costs[name])


def _two_choices(names: list[str], loads: Mapping[str, int], rng: random.Random) -> str:
    """The less loaded of two distinct random candidates (a tie keeps the first drawn)."""
    if len(names) == 1:
        return names[0]
    a, b = rng.sample(names, 2)
    return b if loads[b] < loads[a] else a
