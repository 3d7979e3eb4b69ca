"""The scheduler half of the vLLM connector, free of vLLM and Ray: it answers how many of a
request's tokens L2 can supply, fetches from L3 what L2 lacks, and plans each step's copies
(docs/vllm.md).

vLLM's adapter (kvtier.connector.vllm_connector) calls it from the EngineCore process:
`add` when a request arrives, `match` when vLLM asks for external tokens, `allocated` once
vLLM gave the request its blocks, `plan` once per step, `settle` with the ranks' merged
report, `finish` when the request leaves. Under `write_through` every full block a request
computes (prompt or generated) is saved once, after the step that filled it, unless L2
already holds its page; under `write_through_selective` only once a second request used the
page (hit it in vLLM's prefix cache, or computed it again), from that request's blocks. With
L3, once every rank reported a page saved, the next plan has the ranks write it there.

L3: when L2's run of a prompt's pages ends early, `match` asks the namespace's directory how
many of the following pages L3 holds (published by every rank of whoever wrote them), leases
them and has the ranks read them into L2 slots in the background. With peers on, it also asks
which other instance lists the longest run of them in its L2, and when that run is longer
than L3's the ranks read the pages from that peer's host pools instead (one-sided reads,
verified: kvtier.connector.peer_traffic). A page read by every rank is an L2 page like any
other. Until then `match` answers None (vLLM asks again next step) as
long as the prefetch policy waits: `best_effort` never, `wait_complete` until the reads end,
`timeout` until the config's length-dependent timeout; then it answers what L2 holds.

`take_changes` gives what the router should learn since the last call: pages that became
HELD in L2, were evicted from it, or were STORED in L3 (kvtier.connector.l2_index).
"""
from __future__ import annotations

import dataclasses
import enum
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from kvtier.config import HiCacheConfig
from kvtier.connector.l2_index import FetchSource, L2Change, L2Index, PageOrigin, SlotState
from kvtier.connector.plan import (PageFetch, PageLoad, PageSave, PageStore, StepPlan,
                                   WorkerReport)
from kvtier.keys import KeyNamespace, PageInputs
from kvtier.messages import PeerContact
from kvtier.policies import PrefetchPolicy
from kvtier.vllm_engine.cached import CachedBySource

USES_PER_SLOT = 4  # write_through_selective: use counts kept, per L2 slot
# A page a peer read failed on is not read from a peer again for this long: the holder's
# listing in the directory catches up meanwhile (an evicted page leaves it within a report
# interval, kvtier.actors.l3.l2_reporter), and a request waiting for it does not retry the
# same failing read until its prefetch timeout.
PEER_RETRY_AFTER_S = 2.0
MAX_PEER_MISSES = 4096  # pages remembered so


class L3Directory(Protocol):
    """The L3 namespace's page directory as the scheduler side sees it. Never raises: a
    directory that cannot answer is a miss (kvtier.actors.l3.connector_link)."""

    def lookup(self, keys: Sequence[str]) -> tuple[int, str]:
        """(leading pages of `keys` published, a lease id that keeps them until released)"""
        ...

    def release(self, lease_id: str) -> None: ...

    def report_missing(self, keys: Sequence[str]) -> None: ...


class PeerDirectory(Protocol):
    """Who else holds a prompt's pages in L2, as the scheduler side sees the namespace's
    directory. Never raises: a directory that cannot answer is a miss
    (kvtier.actors.l3.connector_link)."""

    def best_peer(self, keys: Sequence[str]) -> tuple[int, PeerContact | None]:
        """(leading pages of `keys` the best other holder lists, how to reach it)"""
        ...


@dataclass(frozen=True)
class ScheduledRequest:
    """One request in a step, as the plan needs it."""

    req_id: str
    tokens: Sequence[int]  # every token the request has (prompt, then outputs)
    blocks: Sequence[int]  # its vLLM block ids, in order
    computed_after: int  # tokens whose KV is in its blocks once this step ran


@dataclass(slots=True)
class ConnectorCounts:
    """What the connector did so far (tokens and pages)."""

    requests: int = 0
    l2_hit_tokens: int = 0
    l3_hit_tokens: int = 0  # loaded from L2 slots read from L3 for the request
    peer_hit_tokens: int = 0  # loaded from L2 slots read from a peer's L2 for the request
    saved_pages: int = 0
    loaded_pages: int = 0
    failed_saves: int = 0
    failed_loads: int = 0
    l3_lookups: int = 0
    l3_hit_pages: int = 0  # pages L3 said it holds past L2's run
    fetched_pages: int = 0  # of those and of peers', read into L2 by every rank
    failed_fetches: int = 0  # pages some rank could not read
    stale_reports: int = 0  # a rank's report on an earlier fetch of a slot: ignored
    peer_lookups: int = 0
    peer_hit_pages: int = 0  # pages a peer listed past L2's run and L3's, read from it


class Unkeyed(enum.Enum):
    """Why a request's pages cannot be keyed (kvtier.connector.request_inputs): it neither
    loads nor saves, and so never shares a page."""

    ADAPTER = "adapter"  # a LoRA adapter whose weights the connector cannot read
    MULTIMODAL = "multimodal"  # a multimodal item without an identifier


@dataclass
class _Request:
    inputs: PageInputs  # what besides its tokens decides its pages' KV
    unkeyed: Unkeyed | None = None  # set: its pages have no key, it neither loads nor saves
    keys: list[str] = field(default_factory=list)  # chain digests of its full pages so far
    planned_pages: int = 0  # pages before this one were saved, or found in L2
    counted_pages: int = 0  # its pages counted as used (write_through_selective)
    match: tuple[int, list[int]] | None = None  # (first page, L2 slots) of the last match
    load: PageLoad | None = None  # waiting for the next plan
    wait_until: float | None = None  # monotonic deadline of its prefetch, if waiting
    kept: list[int] = field(default_factory=list)  # L2 slots pinned for it (`keep`)
    supplied: CachedBySource = CachedBySource(0, 0)  # tokens of its last load, by source
    loading: tuple[int, ...] = ()  # the L2 slots of its last load


class SchedulerSide:
    """L2 hits and copy plans for one vLLM engine of `tp_size` ranks."""

    def __init__(self, namespace: KeyNamespace, block_size: int, num_slots: int,
                 tp_size: int = 1, l3: L3Directory | None = None,
                 config: HiCacheConfig | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 peers: PeerDirectory | None = None) -> None:
        """`l3`: the namespace's directory when L3 is attached; `peers`: the directory's
        listing of other instances' L2 when the ranks read peers; `config`: the prefetch
        policy and timeouts (peers' reads wait as L3's do)."""
        self.namespace = namespace
        self.block_size = block_size
        self.tp_size = tp_size
        self.index = L2Index(num_slots, tp_size)
        self.l3 = l3
        self.peers = peers
        self.config = config or HiCacheConfig()
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._fetches: list[PageFetch] = []  # for the next plan
        self._stores: list[PageStore] = []  # for the next plan
        # slot -> (page key, lookup lease, source) of the fetches running
        self._fetching: dict[int, tuple[str, str, FetchSource]] = {}
        self._peer_misses: OrderedDict[str, float] = OrderedDict()  # page -> when it failed
        # write_through_selective: a page is saved once this many requests used it (computed
        # or hit it); write_through: 1, every page once computed
        self._hot_after = self.config.write_through_hit_threshold or 1
        self._uses: OrderedDict[str, int] = OrderedDict()  # page -> requests, newest last
        self._max_uses = USES_PER_SLOT * num_slots
        self._counts = ConnectorCounts()
        self._unkeyed: Counter[Unkeyed] = Counter()

    @property
    def counts(self) -> ConnectorCounts:
        return dataclasses.replace(self._counts)

    def add(self, req_id: str, inputs: PageInputs | Unkeyed = PageInputs()) -> None:
        """A new request: what keys its pages (`PageInputs`), or why nothing can."""
        unkeyed = inputs if isinstance(inputs, Unkeyed) else None
        self._requests[req_id] = _Request(PageInputs() if unkeyed else inputs, unkeyed)
        self._counts.requests += 1
        if unkeyed is not None:
            self._unkeyed[unkeyed] += 1

    def take_unkeyed(self) -> Counter[Unkeyed]:
        """Requests added since the last call whose pages could not be keyed, by reason."""
        out, self._unkeyed = self._unkeyed, Counter()
        return out

    def match(self, req_id: str, tokens: Sequence[int], local_tokens: int) -> int | None:
        """Tokens past `local_tokens` (vLLM's own hit, block-aligned) that L2 holds for every
        rank; at least one token is left for vLLM to compute. None: pages are on their way
        from L3 and the prefetch policy waits for them (ask again next step)."""
        req = self._requests[req_id]
        last_page = (len(tokens) - 1) // self.block_size
        first = local_tokens // self.block_size
        req.match = None
        if last_page <= first or req.unkeyed is not None:
            return 0
        self._count_uses(req, self._keys(req, tokens, last_page), last_page)
        keys = self._keys(req, tokens, last_page)[first:last_page]
        slots = self.index.held_run(keys)
        rest = keys[len(slots):]
        if rest and (self.l3 is not None or self.peers is not None) and self._waits(
                req, rest, tokens, first + len(slots)):
            return None
        req.wait_until = None
        req.match = (first, slots)
        return len(slots) * self.block_size

    def held(self, req_id: str, tokens: Sequence[int], local_tokens: int) -> int:
        """Tokens past `local_tokens` whose pages L2 holds for every rank now: `match`'s
        answer without its effects (no use counted, no L3 fetch started, no wait); 0 for a
        request not added. For the scheduler's admission (kvtier.connector.admission)."""
        req = self._requests.get(req_id)
        last_page = (len(tokens) - 1) // self.block_size
        first = local_tokens // self.block_size
        if req is None or last_page <= first or req.unkeyed is not None:
            return 0
        keys = self._keys(req, tokens, last_page)[first:last_page]
        return len(self.index.held_run(keys)) * self.block_size

    def _waits(self, req: _Request, rest: list[str], tokens: Sequence[int], page: int) -> bool:
        """Whether to wait for L3's or a peer's pages past L2's run (`rest`, from page `page`
        of `tokens`): a fetch of the next page is running (started now when the directory
        lists it) and the policy waits for it."""
        num_tokens = len(tokens)
        state = self.index.state(rest[0])
        if state is None:
            if not self._fetch(rest, self._origins(req, tokens, page, len(rest)), page):
                return False
        elif state is not SlotState.FETCHING:
            return False  # being saved by another request: computed here, no wait
        if req.wait_until is None:  # its first wait (a fetch that failed may start again)
            req.wait_until = self._clock() + self._patience(num_tokens)
        return self._clock() < req.wait_until

    def _patience(self, num_tokens: int) -> float:
        policy = self.config.prefetch_policy
        if policy is PrefetchPolicy.BEST_EFFORT:
            return 0.0
        if policy is PrefetchPolicy.WAIT_COMPLETE:
            return self.config.prefetch_timeout_max_s  # bounded all the same: a lost rank
        return self.config.prefetch_timeout_s(num_tokens)

    def _fetch(self, keys: list[str], origins: list[PageOrigin], page: int) -> bool:
        """Start reading the leading pages of `keys` (prompt page `page` on) that L3 holds,
        or a peer's L2 when it lists more of them, into L2; whether any."""
        hit, lease = 0, ""
        if self.l3 is not None:
            self._counts.l3_lookups += 1
            hit, lease = self.l3.lookup(keys)
        peer = None
        if self.peers is not None and hit < len(keys) and not self._peer_missed(keys[hit]):
            self._counts.peer_lookups += 1
            listed, contact = self.peers.best_peer(keys)
            if contact is not None and min(listed, len(keys)) > hit:
                hit, peer = min(listed, len(keys)), contact
                lease = self._release(lease)
        if hit == 0:
            self._release(lease)
            return False
        wanted = []
        for key in keys[:hit]:  # up to a page another request is moving already
            if key in self.index:
                break
            wanted.append(key)
        source = FetchSource.L3 if peer is None else FetchSource.PEER
        slots = self.index.reserve(wanted, SlotState.FETCHING, origins[:len(wanted)], source)
        if not slots:
            self._release(lease)
            return False
        if peer is None:
            self._counts.l3_hit_pages += len(slots)
        else:
            self._counts.peer_hit_pages += len(slots)
        self._fetches.append(PageFetch(tuple(wanted[:len(slots)]), tuple(slots),
                                       self.index.generation(slots[0]), peer, page))
        self._fetching.update({slot: (key, lease, source) for slot, key in zip(slots, wanted)})
        return True

    def _peer_missed(self, key: str) -> bool:
        """Whether a peer read of page `key` failed in the last PEER_RETRY_AFTER_S."""
        at = self._peer_misses.get(key)
        return at is not None and self._clock() - at < PEER_RETRY_AFTER_S

    def _release(self, lease: str) -> str:
        """Give an L3 look-up's lease back (nothing to do for none); ''."""
        if lease and self.l3 is not None:
            self.l3.release(lease)
        return ""

    def keep(self, req_id: str, tokens: Sequence[int]) -> None:
        """The request was pushed back (preempted for another): the pages of `tokens` L2
        holds stay there until it is admitted again or leaves, so that it loads them then."""
        req = self._requests.get(req_id)
        if req is None or req.unkeyed is not None:
            return
        pages = (len(tokens) - 1) // self.block_size
        self._unkeep(req)
        req.kept = self.index.held_run(self._keys(req, tokens, pages)[:pages])
        self.index.pin(req.kept)

    def _unkeep(self, req: _Request) -> None:
        self.index.unpin(req.kept)
        req.kept = []

    def allocated(self, req_id: str, blocks: Sequence[int], external_tokens: int) -> None:
        """vLLM gave the request `blocks` and will take `external_tokens` from the connector:
        the next plan loads them."""
        req = self._requests[req_id]
        self._unkeep(req)  # admitted: its loads are planned now, read before any reuse
        req.supplied = CachedBySource(0, 0)
        pages = external_tokens // self.block_size
        if pages == 0 or req.match is None:
            return
        first, slots = req.match
        if pages > len(slots):
            raise ValueError(f"vLLM asked request {req_id} for {pages} pages from the "
                             f"connector, which matched {len(slots)}")
        self.index.touch(slots[:pages])
        fetched = self.index.take_fetched(slots[:pages])
        req.load = PageLoad(req_id, tuple(slots[:pages]), tuple(blocks[first:first + pages]),
                            fetched.l3, fetched.peer)
        bs = self.block_size
        req.supplied = CachedBySource((pages - fetched.l3 - fetched.peer) * bs,
                                      fetched.l3 * bs, fetched.peer * bs)
        self._counts.l2_hit_tokens += req.supplied.host
        self._counts.l3_hit_tokens += req.supplied.storage
        self._counts.peer_hit_tokens += req.supplied.peer
        self._counts.loaded_pages += pages

    def supplied(self, req_id: str) -> CachedBySource:
        """The tokens the request's last allocation took from the connector, by where they
        were (vLLM asks right after it, and again when the request ends)."""
        req = self._requests.get(req_id)
        return CachedBySource(0, 0) if req is None else req.supplied

    def plan(self, scheduled: Sequence[ScheduledRequest]) -> StepPlan:
        """This step's copies: the loads `allocated` asked for, then a save of every block
        that becomes full in this step and whose page L2 does not have."""
        loads = []
        for req in self._requests.values():
            if req.load is not None:
                loads.append(req.load)
                req.loading, req.load = req.load.slots, None
        saves = [save for s in scheduled if (save := self._saves(s)) is not None]
        fetches, self._fetches = tuple(self._fetches), []
        stores, self._stores = tuple(self._stores), []
        return StepPlan(tuple(loads), tuple(saves), fetches, stores)

    def settle(self, report: WorkerReport) -> None:
        """The ranks' merged report on the last plan, and their background L3 work."""
        saved = report.saved if report.ranks >= self.tp_size else frozenset()
        failed = report.failed_saves | (report.saved - saved)
        held = self.index.settle(saved, failed, backing_up=self.l3 is not None)
        if held and self.l3 is not None:  # every rank saved them: now they may go to L3
            keys, slots = zip(*held)
            self._stores.append(PageStore(keys, slots))
        self.index.stored(report.stored, report.failed_stores)
        fetches = self.index.fetched(report.fetched, report.failed_fetches,
                                     report.held_fetches, report.released)
        self._counts.fetched_pages += len(fetches.done)
        self._counts.failed_fetches += len(fetches.failed)
        self._counts.stale_reports += fetches.stale
        unread = [(key, self._fetching[slot][2]) for slot, key in fetches.failed
                  if slot in self._fetching]
        missing = [key for key, source in unread if source is FetchSource.L3]
        if missing and self.l3 is not None:  # the directory unpublishes them: no retry loop
            self.l3.report_missing(missing)
        for key, source in unread:
            if source is FetchSource.PEER:
                self._peer_misses[key] = self._clock()
                self._peer_misses.move_to_end(key)
        while len(self._peer_misses) > MAX_PEER_MISSES:
            self._peer_misses.popitem(last=False)
        self._end_leases([*fetches.done, *fetches.freed])  # no rank reads them any more
        if report.failed_loads:  # vLLM recomputes them: not what the request got from us
            for req in self._requests.values():
                lost = sum(1 for slot in req.loading if slot in report.failed_loads)
                if lost:
                    req.supplied = req.supplied._replace(
                        failed=req.supplied.failed + lost * self.block_size)
                    req.loading = ()
        dropped = self.index.drop_slots(report.failed_loads)
        self._counts.failed_saves += len(failed)
        self._counts.failed_loads += dropped

    def _end_leases(self, slots: Sequence[int]) -> None:
        """Release a lookup's lease once none of its slots is still being read."""
        ended = {self._fetching.pop(s)[1] for s in slots if s in self._fetching}
        for lease in ended - {lease for _, lease, _ in self._fetching.values()}:
            self._release(lease)

    def finish(self, req_id: str) -> None:
        req = self._requests.pop(req_id, None)
        if req is not None:
            self._unkeep(req)

    def take_changes(self) -> list[L2Change]:
        """What L2 and L3 gained and lost since the last call (`L2Index.take_changes`)."""
        return self.index.take_changes()

    def _saves(self, step: ScheduledRequest) -> PageSave | None:
        req = self._requests.get(step.req_id)
        if req is None or req.unkeyed is not None:
            return None
        full = min(step.computed_after, len(step.tokens)) // self.block_size
        full = min(full, len(step.blocks))
        if full <= req.planned_pages:
            return None
        keys = self._keys(req, step.tokens, full)
        self._count_uses(req, keys, full)
        new = [p for p in range(req.planned_pages, full)
               if keys[p] not in self.index and self._hot(keys[p])]
        req.planned_pages = full
        origins = [self._origins(req, step.tokens, p, 1)[0] for p in new]
        slots = self.index.reserve([keys[p] for p in new], origins=origins)
        if not slots:
            return None
        self._counts.saved_pages += len(slots)
        return PageSave(tuple(step.blocks[p] for p in new[:len(slots)]), tuple(slots),
                        tuple(keys[p] for p in new[:len(slots)]))

    def _count_uses(self, req: _Request, keys: Sequence[str], pages: int) -> None:
        """The request used its pages before `pages` (once each): their use counts grow
        (write_through_selective only; the counts of the pages used longest ago go first)."""
        if self._hot_after <= 1 or pages <= req.counted_pages:
            return
        for key in keys[req.counted_pages:pages]:
            self._uses[key] = self._uses.pop(key, 0) + 1
        req.counted_pages = pages
        while len(self._uses) > self._max_uses:
            self._uses.popitem(last=False)

    def _hot(self, key: str) -> bool:
        """Whether the write policy saves this page now."""
        return self._hot_after <= 1 or self._uses.get(key, 0) >= self._hot_after

    def _origins(self, req: _Request, tokens: Sequence[int], first: int,
                 count: int) -> list[PageOrigin]:
        """Pages `first`.. `first + count - 1` of the request (keyed already): their tokens
        and parents."""
        bs = self.block_size
        inputs = req.inputs
        return [PageOrigin(tuple(tokens[p * bs:(p + 1) * bs]),
                           req.keys[p - 1] if p > 0 else None, inputs.salt,
                           by_tokens=not inputs.adapter and not (
                               inputs.extras(p, 1, bs) or [b""])[0])
                for p in range(first, first + count)]

    def _keys(self, req: _Request, tokens: Sequence[int], pages: int) -> list[str]:
        """The request's first `pages` page keys, extending its chain as tokens arrive."""
        have = len(req.keys)
        if pages > have:
            bs = self.block_size
            req.keys += self.namespace.request_keys(tokens[have * bs:pages * bs], bs,
                                                    req.inputs,
                                                    prior=req.keys[-1] if req.keys else None,
                                                    first_page=have)
        return req.keys
