"""One TP rank of an instance: its model shard, its own L1/L2 cache and an Engine over them.

SPMD: every rank of an instance runs the same Engine on the same request stream, in lockstep.
Logits are identical on every rank (row-parallel all-reduce, replicated LM head), so sampling
gives the same tokens everywhere; where the ranks' caches differ, the scheduler's one
agreement round per step (kvtier.engine.agreement) makes them act alike.

`Rank` is the logic, usable without Ray (a TP=1 rank runs in-process in tests);
`create_rank_actor` wraps it in a Ray actor inside a placement-group bundle, handing it its
settings as a msgpack record (`pack_rank_settings`: Ray pickles what it hands over, and a
weight source or a cache config never crosses pickled). The actor's methods return plain
values, and msgpack for steps and aborts (`actors.step_wire`). It owns
three collaborators, each with its own module: its L3 link (actors/l3/rank_link), its pin desk
(actors/pins) and its hand-off port (actors/pd/rank_port); each remote call of theirs is
one thin method here.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from typing import Any, NamedTuple, Sequence

import ray
import torch
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvtier.actors.l3.peer_link import RankPeerLink
from kvtier.actors.l3.rank_link import RankL3Link, directory_client, open_namespace_backend
from kvtier.actors.pd.rank_port import RankHandoffPort
from kvtier.actors.pins import RankPinDesk
from kvtier.actors.step_wire import (Progress, StepReport, decode_resume, decode_sampling,
                                     encode_output, encode_report)
from kvtier.backends.base import StorageBackend
from kvtier.config import HiCacheConfig, HiCacheConfigRecord
from kvtier.dtypes import DType, name as dtype_name, resolve
from kvtier.engine.agreement import CollectiveAgreement
from kvtier.engine.architectures import build_model
from kvtier.engine.engine import Engine
from kvtier.engine.handoff_desk import DEFAULT_HOLD_S
from kvtier.engine.parallel import SINGLE
from kvtier.engine.tp_group import destroy_tp, init_tp
from kvtier.engine.weight_source_record import WeightSourceRecord, open_source, source_record
from kvtier.engine.weight_sources import WeightSource
from kvtier.errors import ConfigError
from kvtier.frontend.records import RunningConfig
from kvtier.keys import model_part
from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceInfo, pack_record, unpack_record
from kvtier.policies import SchedulePolicy, Transport
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.storage_types import PageDirectoryClient

log = logging.getLogger(__name__)

RANK_NUM_CPUS = 0.5  # fractional: a TP=2 instance fits a 2-CPU Ray next to the driver


class RankSettings(NamedTuple):
    """What every rank of an instance is built from (the same on each). It reaches a rank
    actor as a RankSettingsRecord (`pack_rank_settings`), never pickled."""

    source: WeightSource
    config: HiCacheConfig
    device_pages: int = 64
    dtype: torch.dtype | DType = torch.float32  # DType.AUTO: resolved by each rank for its device
    chunk_tokens: int | None = None
    token_budget: int = 8192
    timeout_s: float = 60.0  # TP group join and every collective
    l3: NamespaceInfo | None = None  # an L3 namespace (from the namespace actor's register):
    # each rank opens its own backend client from it; None keeps config.storage_backend
    l3_actor: str | None = "kvtier-l3"  # with l3: the namespace actor (by name) whose page
    # directory gates L3 hits and hears what each rank stored; None: ask the backend only
    tenant_salt: str = ""  # without l3: seeds this cache's page keys (with l3: the namespace's)
    deterministic: bool = False  # answers bit-identical to a cold run (Engine)
    schedule_policy: SchedulePolicy = SchedulePolicy.LPM
    gpu: bool = False  # each rank asks Ray for a GPU of its own (the only one it then sees):
    # its model and L1 live there, and a TP group meets over NCCL; False: CPU and gloo
    l3_storage: bool = True  # with l3: False attaches the namespace's directory alone, L3
    # off (peer-to-peer L2 finds holders through it: Instance.peer_open)


class RankSettingsRecord(NamedTuple):
    """RankSettings as it crosses to a rank actor, field for field: the weight source as a
    record the rank rebuilds it from (a path's weights checked against the driver's digest),
    the cache config as its validated dict (built, and so checked, again on the rank), the
    dtype as its spelling (a torch dtype by the DType that resolves to it)."""

    source: WeightSourceRecord
    config: HiCacheConfigRecord
    device_pages: int
    dtype: DType
    chunk_tokens: int | None
    token_budget: int
    timeout_s: float
    l3: NamespaceInfo | None
    l3_actor: str | None
    tenant_salt: str
    deterministic: bool
    schedule_policy: SchedulePolicy
    gpu: bool
    l3_storage: bool = True


class PackedRankSettings(NamedTuple):
    """RankSettings packed once for every rank of a set (a model directory's weights are
    hashed in the packing), and what Ray needs to place the ranks."""

    data: bytes  # a msgpack RankSettingsRecord
    gpu: bool  # RankSettings.gpu


def pack_rank_settings(s: RankSettings) -> PackedRankSettings:
    """`s` as the msgpack record a rank actor is spawned with."""
    record = RankSettingsRecord(**{**s._asdict(), "source": source_record(s.source),
                                   "config": HiCacheConfigRecord.of(s.config),
                                   "dtype": _dtype_choice(s.dtype)})
    return PackedRankSettings(pack_record(record), s.gpu)


def unpack_rank_settings(data: bytes) -> RankSettings:
    """The RankSettings in `data` (pack_rank_settings'), the weight source rebuilt here: a
    MessageError for a payload that is no such record, a WeightsChangedError when the weights
    at the source's path are not the ones the driver hashed."""
    record = unpack_record(RankSettingsRecord, data)
    return RankSettings(**{**record._asdict(), "source": open_source(record.source),
                           "config": record.config.config()})


def _dtype_choice(dtype: torch.dtype | DType) -> DType:
    """The DType a rank resolves to `dtype` (float32: fp32, bfloat16: bf16)."""
    if isinstance(dtype, DType):
        return dtype
    choices = {torch.float32: DType.FP32, torch.bfloat16: DType.BF16}
    if dtype not in choices:
        raise ConfigError(f"RankSettings.dtype {dtype}: a rank runs in "
                          f"{', '.join(d.value for d in DType)}; give one of those")
    return choices[dtype]


class RankStats(NamedTuple):
    rank: int
    size: int
    num_kv_heads: int
    steps: int
    agreement_rounds: int
    agreement_s: float
    rolled_back: int
    free_device_pages: int
    device_pages: int
    device_hit_tokens: int
    step_s: float = 0.0  # time inside `step` on this rank (the driver's share is the rest)
    agreement_recent_s: tuple[float, ...] = ()  # the latest rounds' times, for percentiles


class CacheDescription(NamedTuple):
    """A rank cache's key namespace and sizes (the router hashes prompts with it)."""

    model: str
    tenant_salt: str
    layout_fingerprint: str
    page_size: int
    device_pages: int
    host_pages: int
    storage_backend: str | None
    page_bytes: int = 0  # one page over every KV head and part (a namespace's byte quota)
    kv_heads: int = 1  # the model's KV heads (all ranks'): a namespace's NamespaceSpec.kv_heads
    sliding: bool = False  # a hybrid model's sliding-window sidecar: NamespaceSpec.sliding


class RankSnapshot(NamedTuple):
    """A rank's monotonic counters and pool use at one moment, for metrics (`cache_snapshot`;
    the serve graph's `InstanceSnapshot` carries rank 0's on)."""

    counters: dict[str, Any]  # CacheCounters, TransferStats and retraction counters by field
    storage: dict[str, Any] | None  # the L3 backend's stats and StorageCounters (None: no L3)
    host_used_tokens: int
    host_total_tokens: int
    gauges: dict[str, Any]  # L1 use, running and waiting requests
    agreement_s: tuple[float, ...]  # the agreement rounds' seconds since the last snapshot
    pins: dict[str, Any]  # pins held, and their L1 and L2 pages


class Rank:
    """One rank: joins the TP group, builds its shard and cache, and steps its Engine."""

    def __init__(self, rank: int, size: int, init_method: str,
                 settings: RankSettings | bytes) -> None:
        """`settings`: a RankSettings (a rank built in this process), or the packed record a
        Ray actor is spawned with (`create_rank_actor`), which is unpacked and checked here."""
        if isinstance(settings, bytes):
            settings = unpack_rank_settings(settings)
        torch.set_num_threads(1)  # ranks share the machine's cores: one thread each
        self.rank, self.size = rank, size
        self.l3_link = RankL3Link(rank, size, self._open_backend, self._directory)
        self.peer_link = RankPeerLink(rank, size)
        self.device = _own_device(settings.gpu)
        # Under Ray a rank sees only its own GPU: index 0, whatever its rank.
        self.tp = SINGLE if size == 1 else init_tp(
            rank, size, init_method, backend="nccl" if settings.gpu else "gloo",
            timeout_s=settings.timeout_s, device_index=0)
        try:
            self.engine = self._build(settings)
        except Exception:
            destroy_tp()
            raise
        self.pin_desk = RankPinDesk(self.engine.cache, rank)
        self.handoff_port = RankHandoffPort(self.engine, rank, size)
        self.agreement = CollectiveAgreement(self.tp) if size > 1 else None
        self.engine.scheduler.agree = self.agreement
        self.steps = 0
        self.step_s = 0.0
        self.max_report_bytes = 0  # the largest step report so far
        self._reported: dict[int, int] = {}  # request id -> output tokens reported so far
        self._events = None  # a CacheEventLog once watch_cache() is called
        self._snapshot_rounds = 0  # agreement rounds already reported by cache_snapshot
        log.info("rank %d/%d ready: %d KV heads, %d L1 pages", rank, size,
                 self.engine.cache.spec.num_kv_heads, settings.device_pages)

    def _build(self, s: RankSettings) -> Engine:
        cfg = s.source.config()
        device = self.device
        model = build_model(cfg, s.source.state_dict(), resolve(s.dtype, device), device,
                            self.tp)
        spec = model.kv_spec(s.config.page_size)
        if s.l3 is None:
            cache = HierarchicalCache(s.config, spec, s.device_pages, device=model.device,
                                      model=model_part(_identity(s.source, cfg)),
                                      tenant_salt=s.tenant_salt,
                                      tp_rank=self.rank, tp_size=self.size,
                                      deterministic=s.deterministic)
        else:
            cache = self.l3_link.build_cache(s, spec, model.device)
        return Engine(model, cache, s.chunk_tokens, s.token_budget, owns_cache=True,
                      deterministic=s.deterministic, schedule_policy=s.schedule_policy)

    # ---- the request stream (every rank gets the same calls, in the same order) ------------
    def add_request(self, tokens: Sequence[int], sampling: bytes,
                    cache_salt: str = "", resume: bytes | None = None,
                    request_id: int | None = None) -> int:
        """Queue a request (`sampling`: its SamplingParams record, actors.step_wire);
        `resume` (a Resume record): the start of its answer the caller has already, which it
        goes on after and never reports again. `request_id`: the instance's id for it (one
        id from the server to the ranks); its id."""
        got = decode_resume(resume)
        req_id = self.engine.add_request([int(t) for t in tokens], decode_sampling(sampling),
                                         cache_salt, resume=got, request_id=request_id)
        if got is not None:
            self._reported[req_id] = len(got.tokens)
        return req_id

    def step(self) -> bytes:
        """One scheduling step: a msgpack `StepReport` (actors.step_wire). Finished outputs
        travel without their prefill logits; rank 0 also reports the tokens of running
        requests that changed and the cache events since the last step (when `watch_cache`
        asked)."""
        start = time.perf_counter()
        self.steps += 1
        try:
            finished = self.engine.step()
            self.pin_desk.refresh()
            self.l3_link.follow(self.engine.cache)
            handoffs = self.handoff_port.send_new()
        finally:
            self.step_s += time.perf_counter() - start
        if self.rank != 0:
            return self._reported_bytes(encode_report(StepReport(finished, {}, None, handoffs)))
        batch = self._events.drain() if self._events is not None else None
        return self._reported_bytes(encode_report(StepReport(
            finished, self._progress(), None if batch is None else batch.to_msgpack(),
            handoffs)))

    def _reported_bytes(self, report: bytes) -> bytes:
        """Keep the largest step report's size (what a step sends through Ray)."""
        self.max_report_bytes = max(self.max_report_bytes, len(report))
        return report

    def _progress(self) -> dict[int, Progress]:
        """Running requests whose answer grew since the last step: the new tokens only (a
        preempted request keeps its answer and goes on after it; one that runs again from
        its prompt in deterministic mode repeats its tokens, reported once)."""
        sched, changed = self.engine.scheduler, {}
        for req in sched.running:
            have, n = self._reported.get(req.id, 0), len(req.resumed) + len(req.output)
            if n > have:
                tokens, logprobs = req.tail(n - have)
                changed[req.id] = Progress(have, tokens, logprobs)
                self._reported[req.id] = n
        if len(self._reported) > len(sched.running):  # forget finished and aborted ones
            live = {r.id for r in sched.running} | {r.id for r in sched.waiting}
            for req_id in [i for i in self._reported if i not in live]:
                del self._reported[req_id]
        return changed

    def drain_events(self) -> bytes | None:
        """Cache events recorded outside steps (a flush, an eviction on request), msgpack."""
        batch = self._events.drain() if self._events is not None else None
        return None if batch is None else batch.to_msgpack()

    def watch_cache(self, instance: str) -> None:
        """Record this rank's cache events (pages entering and leaving each tier) for the
        router; they come back with every step. Rank 0 speaks for the instance."""
        from kvtier.frontend.cache_events import CacheEventLog
        self._events = CacheEventLog(instance)
        self.engine.cache.set_event_listener(self.peer_link.listener(self._events))

    def running_config(self) -> bytes:
        """What this rank runs with: a RunningConfig record (`kvtier.frontend.records`)."""
        engine, l3 = self.engine, self.engine.cache.l3_kind
        return pack_record(RunningConfig(
            HiCacheConfigRecord.of(engine.cache.config),
            l3.value if l3 is not None else None,  # attached
            engine.cache.namespace.model,  # the cache namespace's model part
            dtype_name(engine.model.dtype), engine.runner.chunk_tokens,
            engine.scheduler.deterministic, engine.scheduler.policy.value,
            engine.cache.device_pages, engine.cache.host_pages))

    def describe(self) -> bytes:
        """What a router needs to compute this cache's page keys from tokens: a
        CacheDescription record (kvtier.messages `unpack_record`)."""
        cache = self.engine.cache
        ns, l3 = cache.namespace, cache.l3_kind
        return pack_record(CacheDescription(
            ns.model, ns.tenant_salt, ns.layout_fingerprint, cache.spec.page_size,
            cache.device_pages, cache.host_pages, l3.value if l3 is not None else None,
            cache.spec.page_bytes * self.size, cache.heads.total, cache.spec.sliding is not None))

    def cache_snapshot(self) -> bytes:
        """A RankSnapshot record: monotonic counters (cache, L3) and pool use, for metrics.
        It is also the metrics
        tick's pin upkeep (`refresh`, as a step does): an idle instance takes no steps, and its
        lapsed pins must still let go of their pages (and leave the figures)."""
        self.pin_desk.refresh()
        pins = self.pin_desk.figures()
        snap = self.engine.cache.snapshot()
        page = snap.page_size
        storage = None
        if snap.l3 is not None:
            backend = dataclasses.asdict(snap.l3.backend)
            backend.pop("extra", None)
            storage = {**backend, **snap.l3.counters.snapshot()}
        sched = self.engine.scheduler
        gauges = {"device_used_tokens": (snap.device_pages - snap.free_device_pages) * page,
                  "device_total_tokens": snap.device_pages * page,
                  "running_requests": len(sched.running), "waiting_requests": len(sched.waiting)}
        # the L1<->L2 copies' bytes and seconds (TransferStats) join the token counters
        counters = {**snap.counters.snapshot(), **snap.transfers._asdict(),
                    **sched.retraction.counters.snapshot()}
        return pack_record(RankSnapshot(counters, storage, snap.used_host_pages * page,
                                        snap.host_pages * page, gauges,
                                        self._new_agreement_times(), pins))

    def _new_agreement_times(self) -> tuple[float, ...]:
        """The agreement rounds' times since the last snapshot (the latest 4096 at most)."""
        agr = self.agreement
        if agr is None:
            return ()
        new = min(agr.rounds - self._snapshot_rounds, len(agr.times_s))
        self._snapshot_rounds = agr.rounds
        return tuple(agr.times_s)[len(agr.times_s) - new:] if new else ()

    def retraction_counters(self) -> bytes:
        """Requests this rank retracted to L2 and restored, and the fallbacks to recompute: a
        RetractionCounters record."""
        return pack_record(self.engine.scheduler.retraction.counters)

    def abort(self, request_id: int) -> bytes:
        """The aborted request's output so far (msgpack; nil when it is unknown or done)."""
        return encode_output(self.engine.abort(request_id))

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished

    # ---- inspection (tests, benchmarks; faults are injected by a subclass in the tests) -------
    def stats(self) -> bytes:
        """A RankStats record (kvtier.messages `unpack_record`)."""
        cache, agr = self.engine.cache, self.agreement
        return pack_record(RankStats(self.rank, self.size, cache.spec.num_kv_heads, self.steps,
                                     agr.rounds if agr else self.steps,
                                     agr.total_s if agr else 0.0,
                                     self.engine.scheduler.rolled_back,
                                     cache.free_device_pages, cache.device_pages,
                                     cache.counters.device_hit_tokens, self.step_s,
                                     tuple(agr.times_s) if agr else ()))

    def audit(self) -> bytes:
        """What this rank's cache holds outside its tree (all zero when nothing leaked), after
        copies in flight and L3 backups have settled: a CacheAudit record."""
        self.quiesce()
        return pack_record(self.engine.cache.audit())

    def drop_cache(self) -> int:
        """Evict every unlocked page of L1 and L2 on this rank only; L1 pages free after."""
        cache = self.engine.cache
        cache.drop_unlocked()
        return cache.free_device_pages

    def quiesce(self) -> None:
        """Wait for queued L1<->L2 copies and L2->L3 backups (before a timed request); after
        an L3 directory outage, check the namespace now, so what waited is reported."""
        cache = self.engine.cache
        cache.quiesce()
        if cache.l3_directory_away:
            self.l3_link.follow(cache, force=True)

    def evict_device(self) -> int:
        """Evict every unlocked L1 page on this rank (backed-up runs stay in L2); free L1
        pages after."""
        cache = self.engine.cache
        cache.flush()
        cache.evict_device(cache.device_pages)
        return cache.free_device_pages

    def close(self) -> None:
        self._close_peers()
        self.engine.close()
        self.handoff_port.close()
        destroy_tp()

    # ---- peer-to-peer L2 (actors/l3/peer_link) ----------------------------------------------
    def peer_open(self, holder: str, incarnation: str, transport: str,
                  report_l2: bool = False) -> None:
        """Lend this rank's L2 pages to other instances and read theirs, as L2 holder
        `holder` in its start `incarnation`, over a `transport` endpoint
        (RankPeerLink.open); L3 must be attached."""
        cache = self.engine.cache
        self._close_peers()
        self.peer_link.open(cache, self.l3_link.directory, holder, incarnation,
                            Transport.parse(transport, "peer transport"), report_l2)
        if self.peer_link.reporter is not None:
            cache.set_event_listener(self.peer_link.listener(self._events))

    def _close_peers(self) -> None:
        """Stop lending and reading; the cache's events go to the router's log alone again."""
        reported = self.peer_link.reporter is not None
        self.peer_link.close(self.engine.cache)
        if reported:
            self.engine.cache.set_event_listener(self._events)

    def peer_counters(self) -> bytes:
        """What this rank's reads from peers moved and took: a PeerReadCounters record."""
        return pack_record(self.peer_link.counters())

    def peer_raw_read(self, tokens: list[int], salt: str = "",
                      start_at: float | None = None) -> bytes:
        """The benchmark's baseline (RankPeerLink.raw_read): a RawPeerRead record."""
        return pack_record(self.peer_link.raw_read(self.engine.cache, self.l3_link.directory,
                                                   tokens, salt, start_at))

    # ---- L3 (actors/l3/rank_link) ---------------------------------------------------------------
    def _open_backend(self, info: NamespaceInfo, heads: HeadRange) -> StorageBackend:
        """This rank's client of the namespace's storage (a subclass may wrap it)."""
        return open_namespace_backend(info, heads)

    def _directory(self, l3_actor: str) -> PageDirectoryClient:
        """This rank's client of the namespace actor's page directory (a subclass may wrap
        it)."""
        return directory_client(l3_actor)

    def attach_l3(self, info: bytes, l3_actor: str | None, storage: bool = True) -> str:
        """Attach the registered namespace `info` (a msgpack NamespaceInfo) as L3; its
        backend's kind (RankL3Link.attach_l3; `storage` False: its directory alone)."""
        return self.l3_link.attach_l3(self.engine.cache, info, l3_actor, storage)

    def detach_l3(self) -> None:
        """Stop using L3 (queued backups finish first; nothing leaks), and peers, which find
        each other through its directory (peer_open again after the next attach)."""
        self._close_peers()
        self.l3_link.detach(self.engine.cache)

    # ---- pins (actors/pins) ---------------------------------------------------------------
    def pin_held(self, tokens: Sequence[int], salt: str = "") -> int:
        """Whole pages of `tokens` this rank holds in L1 or L2 (the instance pins the MIN)."""
        return self.pin_desk.held(tokens, salt)

    def pin(self, pin_id: str, tokens: Sequence[int], pages: int, ttl_s: float,
            max_fraction: float, salt: str = "", tenant: str = "") -> bytes:
        """Pin the first `pages` whole pages: a PinOutcome or PinRefusal record (a value: an
        exception would count as a rank fault; RankPinDesk.pin)."""
        return self.pin_desk.pin(pin_id, tokens, pages, ttl_s, max_fraction, salt, tenant)

    def unpin(self, pin_id: str) -> bool:
        return self.pin_desk.unpin(pin_id)

    def pins(self) -> bytes:
        """This rank's live pins: PinListing records (`pack_records`)."""
        return self.pin_desk.describe()

    # ---- prefill/decode hand-off (actors/pd/rank_port) -------------------------------------------
    def handoff_open(self, transport: str, staged: bool = False) -> bytes:
        """Open this rank's endpoint with its L1 pool registered; its address
        (RankHandoffPort.open)."""
        return self.handoff_port.open(transport, staged)

    def handoff_reserve(self, handoff_id: str, num_tokens: int,
                        hold_s: float = DEFAULT_HOLD_S, staged: bool = False) -> bytes | None:
        """Reserve pages for a prompt; this rank's HandoffTarget record, or None when there
        is no room (RankHandoffPort.reserve)."""
        return self.handoff_port.reserve(handoff_id, num_tokens, hold_s, staged)

    def handoff_cancel(self, handoff_id: str, linger_s: float = 0.0) -> bool:
        return self.handoff_port.cancel(handoff_id, linger_s)

    def add_received(self, tokens: Sequence[int], sampling: bytes, cache_salt: str,
                     incoming: bytes, request_id: int | None = None) -> int:
        """Queue a decode request over its received pages (SamplingParams and IncomingKV
        records); its id."""
        return self.handoff_port.add_received(tokens, sampling, cache_salt, incoming,
                                              request_id)

    def add_handoff_request(self, tokens: Sequence[int], sampling: bytes,
                            cache_salt: str, targets: list[bytes],
                            request_id: int | None = None) -> int:
        """Queue a prefill request whose prompt KV goes to `targets` once computed."""
        return self.handoff_port.add_request(tokens, sampling, cache_salt, targets, request_id)

    def release_handoff(self, request_id: int) -> bool:
        """The decode side holds the request's KV now: its pages join this rank's cache."""
        return self.handoff_port.release(request_id)

    def handoff_raw_write(self, targets: list[bytes], through_kvtier: bool = False
                          ) -> tuple[int, float]:
        """The benchmark's baseline: the transport alone makes a hand-off's writes; (bytes,
        seconds) (RankHandoffPort.raw_write)."""
        return self.handoff_port.raw_write(targets, through_kvtier)

    def handoff_counters(self) -> bytes:
        """This rank's hand-off counters: a RankTransportCounters record."""
        return self.handoff_port.counters(self.max_report_bytes)


def _own_device(gpu: bool) -> torch.device:
    """The rank's device: the one GPU Ray gave it, or the CPU."""
    if not gpu:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"this rank's bundle has a GPU but torch {torch.__version__} sees "
                          f"no CUDA device (a CPU build of torch, or CUDA_VISIBLE_DEVICES "
                          f"emptied); install torch's CUDA build on the GPU nodes, or set "
                          f"gpus_per_rank to 0")
    return torch.device("cuda", 0)


def namespace_model(source: WeightSource) -> str:
    """The model part of the cache namespace ranks built from `source` key their pages with:
    an L3 namespace registered for such ranks names the same."""
    return model_part(_identity(source, source.config()))


def _identity(source: WeightSource, cfg) -> str:
    """The model part of the cache namespace: the checkpoint's name and, where the source can
    tell (a model directory: a digest of its weight files), which weights these are."""
    identity = getattr(source, "identity", None)
    return identity() if identity is not None else cfg.name




def create_rank_actor(rank: int, size: int, init_method: str, settings: PackedRankSettings,
                      placement_group: object, num_cpus: float = RANK_NUM_CPUS,
                      rank_class: type[Rank] = Rank) -> object:
    """A Ray actor running `rank_class` (Rank or a subclass) in bundle `rank` of
    `placement_group` (with `settings.gpu`, on its bundle's GPU), spawned with the packed
    settings' bytes (`pack_rank_settings`)."""
    gpus = {"num_gpus": 1} if settings.gpu else {}
    actor_cls = ray.remote(rank_class).options(
        num_cpus=num_cpus, **gpus, max_concurrency=1, name=f"kvtier-rank-{uuid.uuid4().hex}",
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group, placement_group_bundle_index=rank))
    return actor_cls.remote(rank, size, init_method, settings.data)
