"""`KvtierConnector`: kvtier's L2 and L3 under vLLM, as a vLLM v1 KV connector.

vLLM builds one instance per process: in EngineCore with the scheduler role (it answers
`get_num_new_matched_tokens` and plans each step: kvtier.connector.scheduler_side) and in
each worker with the worker role (it copies between vLLM's blocks and its host pool:
kvtier.connector.worker_side). This module only translates vLLM's objects into theirs. Load
it with `--kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_role": "kv_both"}'`
once kvtier is installed (its `vllm.general_plugins` entry point registers the name), or
with `"kv_connector_module_path": "kvtier.connector.vllm_connector"`. See docs/vllm.md.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorWorkerMetadata)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvtier.backends.transport_registry import open_endpoint
from kvtier.connector.identity import BlockIdentity, block_namespace, config_digest
from kvtier.connector.l2_index import L2Change, L2ChangeKind
from kvtier.connector.l3_traffic import L3Traffic
from kvtier.connector.peer_traffic import PeerTraffic
from kvtier.connector.plan import StepPlan, WorkerReport
from kvtier.connector.request_inputs import AdapterDigests, page_inputs
from kvtier.connector.scheduler_side import ScheduledRequest, SchedulerSide, Unkeyed
from kvtier.connector.settings import CONNECTOR, DIRECTORY_BACKEND, ConnectorSettings
from kvtier.connector.stats import FAMILIES
from kvtier.connector.supported import refuse_unsupported, refuse_unsupported_spec
from kvtier.vllm_engine.copy_stats import CopyStats
from kvtier.connector.worker_side import WorkerSide
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceInfo, NamespaceSpec
from kvtier.tiers.peer_pages import PeerLender, PeerReader

if TYPE_CHECKING:
    from kvtier.actors.l3.connector_link import DirectoryLink
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


@dataclass
class KvtierStepMeta(KVConnectorMetadata):
    """Scheduler -> workers: this step's plan."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KvtierWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: one rank's report, merged over the ranks by vLLM."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KvtierWorkerMeta":
        if not isinstance(other, KvtierWorkerMeta):
            raise TypeError(f"cannot merge a {type(other).__name__} into kvtier's report")
        return KvtierWorkerMeta(self.report.merge(other.report))


@dataclass
class KvtierStats(KVConnectorStats):
    """vLLM's container for the workers' `CopyStats` (its payload is `CopyStats`'s)."""

    def copies(self) -> CopyStats:
        return CopyStats.from_payload(self.data)

    def aggregate(self, other: KVConnectorStats) -> "KvtierStats":
        other_copies = CopyStats.from_payload(other.data)
        return KvtierStats((self.copies() + other_copies).to_payload())

    def reset(self) -> None:
        self.data = {}

    def reduce(self) -> dict[str, int | float]:
        copies = self.copies()
        load, save = copies.gbps()
        return {"hit_tokens": copies.hit_tokens, "backup_tokens": copies.backup_tokens,
                "load_gbps": round(load, 3), "save_gbps": round(save, 3)}

    def is_empty(self) -> bool:
        return self.copies().empty


class KvtierPromMetrics(KVConnectorPromMetrics):
    """kvtier's counter families (kvtier.connector.stats.FAMILIES) in vLLM's registry."""

    def __init__(self, vllm_config: "VllmConfig", metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = []
        families: dict[str, Any] = {}  # one counter per family, a child per label set
        for family, labels, field_name, text in FAMILIES:
            if family not in families:
                families[family] = self._counter_cls(name=family, documentation=text,
                                                     labelnames=[*labelnames, *labels])
            per_engine = {idx: families[family].labels(*values, *labels.values())
                          for idx, values in per_engine_labelvalues.items()}
            self._counters.append((field_name, per_engine))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        copies = CopyStats.from_payload(transfer_stats_data)
        for field_name, per_engine in self._counters:
            value = getattr(copies, field_name)
            if value:
                per_engine[engine_idx].inc(value)


def connector_events(changes: Sequence[L2Change], block_size: int) -> list["KVCacheEvent"]:
    """L2's and L3's changes as vLLM's KV events: a page HELD in L2 is stored on medium CPU,
    one STORED in L3 stored on medium STORAGE, one EVICTED from L2 removed from CPU. A page's
    hash is its kvtier key's 32 bytes and its parent's the key before it, so a subscriber keys
    it by its tokens as it keys vLLM's own blocks (kvtier.vllm_engine.kv_events); the chain's
    first page carries the request's cache salt in `extra_keys`, as vLLM's do. Consecutive
    changes of one kind along one chain go in one event."""
    from vllm.distributed.kv_events import (MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved,
                                            BlockStored)

    events: list[Any] = []
    run: list[L2Change] = []

    def flush() -> None:
        if not run:
            return
        first = run[0]
        hashes = [bytes.fromhex(c.key) for c in run]
        if first.kind is L2ChangeKind.EVICTED:
            events.append(BlockRemoved(block_hashes=hashes, medium=MEDIUM_CPU))
        else:
            origin = first.origin
            assert origin is not None
            salt = [(origin.salt,)] if origin.parent is None and origin.salt else None
            events.append(BlockStored(
                block_hashes=hashes,
                parent_block_hash=None if origin.parent is None else bytes.fromhex(origin.parent),
                token_ids=[t for c in run for t in c.origin.tokens],  # type: ignore[union-attr]
                block_size=block_size, lora_id=None, lora_name=None, extra_keys=salt,
                medium=MEDIUM_CPU if first.kind is L2ChangeKind.HELD else MEDIUM_STORAGE))
        run.clear()

    for change in changes:
        if change.kind is not L2ChangeKind.EVICTED and (
                change.origin is None or not change.origin.by_tokens):
            continue  # reserved without its page, or keyed by more than its tokens and salt:
            # a subscriber keying pages by their tokens would mistake it for another page
        if run and (change.kind is not run[-1].kind or (
                change.kind is not L2ChangeKind.EVICTED
                and change.origin.parent != run[-1].key)):  # type: ignore[union-attr]
            flush()
        run.append(change)
    flush()
    return events


def skips_reading(request: "Request") -> bool:
    """Whether `request` may not read cached KV (vLLM sets it for `prompt_logprobs`, which
    need every prompt token computed; users may set it too)."""
    return bool(getattr(request, "skip_reading_prefix_cache", False))


def device_kind() -> str:
    """What the block bytes depend on besides the backend: the CPU's ISA or the GPU."""
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"cuda-sm{major}{minor}"
    return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"


class KvtierConnector(KVConnectorBase_V1):
    """kvtier's tiers under vLLM (the class vLLM loads by name)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        refuse_unsupported(vllm_config)  # before anything is built for it
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        groups = kv_cache_config.kv_cache_groups
        spec = refuse_unsupported_spec(groups)
        self._block_size = spec.block_size
        self._slots = self._settings.host_slots(
            kv_cache_config.num_blocks, spec.page_size_bytes * len(groups[0].layer_names))
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._namespace = self._key_namespace(vllm_config, spec)
        self._total_heads = vllm_config.model_config.get_total_num_kv_heads()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._report = WorkerReport()
        self._l2_reporter: Any = None  # an L2Reporter with L3 or peers: the directory
        # learns our L2
        self._lending: tuple[Any, Any, Any] | None = None  # a worker's (PeerLender,
        # endpoint, ContactKeeper)
        if role is KVConnectorRole.SCHEDULER:
            self._recompute_failed_loads()
            self._requests: dict[str, "Request"] = {}
            self._blocks: dict[str, list[int]] = {}
            self._adapters = AdapterDigests()
            link = self._directory(spec)
            self._scheduler = SchedulerSide(self._namespace, self._block_size, self._slots,
                                            self._tp_size, link if self._settings.l3 else None,
                                            self._settings.cache,
                                            peers=link if self._settings.peer else None)
            log.info("%s: L2 of %d pages of %d tokens per rank%s%s", CONNECTOR, self._slots,
                     self._block_size, ", L3 attached" if self._settings.l3 else "",
                     f", peers over {self._settings.peer.value}" if self._settings.peer
                     else "")

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No (vLLM 0.33 asks): the workers hold views of the KV tensors that sleep remaps."""
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes: under full CUDA graphs vLLM replays a graph that skips `wait_for_layer_load`,
        so a layer would read its blocks before the copy into them landed. vLLM then runs
        piecewise graphs (attention outside the graphs; docs/vllm.md says what it costs)."""
        return True

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that did not happen is a later miss, nothing more

    def _recompute_failed_loads(self) -> None:
        """A block that fails to load is recomputed, never an error: vLLM reads this policy
        right after building the scheduler's connector."""
        config = self._kv_transfer_config
        if config.kv_load_failure_policy != "recompute":
            log.info("%s: setting kv_load_failure_policy to recompute (was %s)", CONNECTOR,
                     config.kv_load_failure_policy)
            object.__setattr__(config, "kv_load_failure_policy", "recompute")

    def _namespace_spec(self, spec: Any) -> NamespaceSpec:
        """The L3 namespace of this engine's blocks (every process computes the same). With
        L3 off and peers on, the namespace whose directory alone the engines find each other
        through: registered on a file root (`directory_root`) that nothing writes."""
        s = self._settings
        cache = s.cache
        if cache.storage_backend is None:
            backend, options = DIRECTORY_BACKEND, {"root_dir": s.directory_root()}
        else:
            assert cache.storage_options is not None
            backend, options = cache.storage_backend, cache.storage_options.to_dict()
        ns = self._namespace
        page_bytes = spec.page_size_bytes * self._vllm_config.model_config.get_num_layers(
            self._vllm_config.parallel_config) * self._tp_size
        return NamespaceSpec(ns.model, ns.tenant_salt, ns.layout_fingerprint, backend, options,
                             kv_heads=self._total_heads, page_bytes=page_bytes)

    def _register_namespace(self, spec: Any) -> NamespaceInfo:
        from kvtier.actors.l3.connector_link import register_namespace

        s = self._settings
        return register_namespace(s.ray_address, self._namespace_spec(spec), s.l3_actor,
                                  s.l3_state_dir)

    @property
    def _holder(self) -> str:
        """This engine's name in the directory's L2 listing: vLLM's engine id
        (kv_transfer_config.engine_id; kvtier serve: the instance's name)."""
        return str(self._kv_transfer_config.engine_id)

    @property
    def _incarnation(self) -> str:
        """This start of the engine in the directory's L2 listing (tiers/l2_holders.py):
        vLLM's instance id, the time in ns at which the engine's VllmConfig was built
        (VllmConfig.__post_init__). The scheduler's process and every worker's receive
        that config pickled, and unpickling runs no __post_init__, so all of an engine's
        processes carry the same id, and a restart (a new config) a new one."""
        return str(self._vllm_config.instance_id)

    def _directory(self, spec: Any) -> "DirectoryLink | None":
        """The scheduler side's link to the namespace's directory (None: neither L3 nor
        peers)."""
        if not self._settings.directory:
            return None
        from kvtier.actors.l3.connector_link import DirectoryLink

        s = self._settings
        info = self._register_namespace(spec)
        link = DirectoryLink(s.ray_address, info, s.l3_actor, self._holder,
                             self._incarnation)
        self._l2_reporter = link.l2_reporter()  # reports and renews the engine's lease
        return link

    def _attach_l3(self, worker: WorkerSide) -> None:
        """This worker's storage client (its own KV heads) and background traffic."""
        from kvtier.actors.l3.connector_link import WorkerStorage
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        s = self._settings
        info = self._register_namespace(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec)
        heads = HeadRange.of_rank(self._total_heads, get_tensor_model_parallel_rank(),
                                  self._tp_size)
        storage = WorkerStorage(s.ray_address, info, heads, s.l3_actor)
        worker.attach_l3(L3Traffic(storage.backend, worker.host, storage.report_stored))

    def _attach_peers(self, worker: WorkerSide) -> None:
        """This worker lends its host pool to the namespace's other engines and reads
        theirs, over an endpoint of its own (kvtier.connector.peer_traffic)."""
        from kvtier.actors.l3.connector_link import register_peer
        from kvtier.actors.l3.peer_link import PEER_READ_TIMEOUT_S
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        s = self._settings
        assert s.peer is not None
        info = self._register_namespace(self._kv_cache_config.kv_cache_groups[0].kv_cache_spec)
        rank = get_tensor_model_parallel_rank()
        heads = HeadRange.of_rank(self._total_heads, rank, self._tp_size)
        endpoint = open_endpoint(s.peer, f"vllm-{self._holder}-{rank}")
        lender = None
        try:
            lender = PeerLender(worker.peer_pool, endpoint, heads, worker.lend)
            reader = PeerReader(worker.peer_pool, endpoint, heads, PEER_READ_TIMEOUT_S)
            worker.attach_peers(PeerTraffic(reader))
            # registered again on an interval: the contact lives under the engine's lease
            keeper = register_peer(s.ray_address, info, self._holder,
                                   self._incarnation,
                                   lender.contact(rank, self._tp_size, f"vllm worker {rank}"),
                                   s.l3_actor)
        except BaseException:
            if lender is not None:
                lender.close()
            endpoint.close()
            raise
        self._lending = (lender, endpoint, keeper)

    @staticmethod
    def _key_namespace(vllm_config: "VllmConfig", spec: Any) -> KeyNamespace:
        import vllm

        mc = vllm_config.model_config
        backend = vllm_config.attention_config.backend
        identity = BlockIdentity(
            engine=f"vllm {vllm.__version__}",
            attention_backend=backend.name if backend is not None else "auto",
            device=device_kind(), kv_dtype=str(spec.dtype), block_size=spec.block_size,
            num_layers=mc.get_num_layers(vllm_config.parallel_config),
            total_kv_heads=mc.get_total_num_kv_heads(), head_dim=mc.get_head_size(),
            config=config_digest(mc, vllm_config.cache_config))
        return block_namespace(mc.model, identity)

    # ---- scheduler side ------------------------------------------------------------------
    def on_new_request(self, request: "Request") -> None:
        self._requests[request.request_id] = request
        self._sched.add(request.request_id,
                        page_inputs(request, self._block_size, self._adapters))

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if skips_reading(request):  # prompt_logprobs, or asked: its pages are still saved
            return 0, False
        return self._sched.match(request.request_id, request.all_token_ids,
                                 num_computed_tokens), False

    def held_tokens(self, request: "Request", num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (block-aligned) L2 holds for the request now,
        with no effect on it (kvtier.connector.vllm_scheduler asks)."""
        return self._sched.held(request.request_id, request.all_token_ids, num_computed_tokens)

    def keep_for(self, request: "Request") -> None:
        """`request` was preempted for another (kvtier.connector.vllm_scheduler): the pages L2
        holds of it stay until it is admitted again or finishes."""
        self._sched.keep(request.request_id, request.all_token_ids)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        block_ids = list(blocks.get_block_ids()[0])
        self._sched.allocated(request.request_id, block_ids, num_external_tokens)

    def get_external_cache_hit_sources(self, request: "Request",
                                       num_external_tokens: int) -> dict[CacheHitSource, int]:
        """Tokens from pages L2 held as host hits, from pages read from L3 for the request as
        disk hits (vLLM's nearest word for shared storage), from pages read from a peer's
        L2 for it as P2P hits."""
        supplied = self._sched.supplied(request.request_id)
        sources = {CacheHitSource.HOST: supplied.host, CacheHitSource.DISK: supplied.storage,
                   CacheHitSource.P2P: supplied.peer}
        return {source: n for source, n in sources.items() if n}

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KvtierStepMeta:
        out = scheduler_output
        steps = []
        for new in out.scheduled_new_reqs:
            self._blocks[new.req_id] = list(new.block_ids[0])
            steps.append(self._scheduled(new.req_id, new.num_computed_tokens, out))
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                self._blocks[req_id] = list(new_ids[0]) if new_ids else []
            elif new_ids is not None:
                self._blocks.setdefault(req_id, []).extend(new_ids[0])
            steps.append(self._scheduled(req_id, cached.num_computed_tokens[i], out))
        return KvtierStepMeta(self._sched.plan([s for s in steps if s is not None]))

    def _scheduled(self, req_id: str, computed: int,
                   out: "SchedulerOutput") -> ScheduledRequest | None:
        request = self._requests.get(req_id)
        if request is None:
            return None
        return ScheduledRequest(req_id, request.all_token_ids, self._blocks.get(req_id, []),
                                computed + out.num_scheduled_tokens.get(req_id, 0))

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvtierWorkerMeta):
            self._sched.settle(meta.report)

    def take_events(self) -> Iterable["KVCacheEvent"]:
        """What L2 and L3 gained and lost since the last step, as vLLM's KV events (vLLM
        publishes them with its own when `kv_events_config` enables events)."""
        if self._scheduler is None:
            return ()
        changes = self._scheduler.take_changes()
        if self._l2_reporter is not None:
            self._l2_reporter.held(c.key for c in changes if c.kind is L2ChangeKind.HELD)
            self._l2_reporter.dropped(c.key for c in changes if c.kind is L2ChangeKind.EVICTED)
        return connector_events(changes, self._block_size)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        self._blocks.pop(request.request_id, None)
        supplied = self._sched.supplied(request.request_id)
        self._sched.finish(request.request_id)
        return False, supplied.to_params() if any(supplied) else None

    @property
    def _sched(self) -> SchedulerSide:
        if self._scheduler is None:
            raise RuntimeError(f"{CONNECTOR}: a scheduler hook was called on a worker")
        return self._scheduler

    # ---- worker side ---------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        spec = self._kv_cache_config.kv_cache_groups[0].kv_cache_spec
        expected = (self._kv_cache_config.num_blocks, spec.num_kv_heads, spec.block_size,
                    spec.head_size)
        self._worker = WorkerSide(kv_caches, self._slots, block_size=self._block_size,
                                  counts_tokens=get_tensor_model_parallel_rank() == 0,
                                  expected=expected)  # the layout, told from the shapes
        if self._settings.l3:
            self._attach_l3(self._worker)
        if self._settings.peer is not None:
            self._attach_peers(self._worker)
        log.info("%s: host pool of %d pages, %.1f MB; vLLM's KV in the %s layout", CONNECTOR,
                 self._slots, self._slots * self._worker.shape.slot_bytes / 1e6,
                 self._worker.layout.value)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        self._work.begin_step(self._bound_plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # CUDA: this layer's copies (start_load_kv queued them layer by layer on a stream of
        # their own) land before its attention; on CPU they all landed before the forward
        self._work.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # full blocks are saved after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self._report = self._work.end_step(self._bound_plan())

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._lending is not None:  # after the reads: they use the endpoint
            lender, endpoint, keeper = self._lending
            keeper.close()  # the scheduler's reporter has the directory forget the contact
            lender.close()
            endpoint.close()
            self._lending = None
        if self._l2_reporter is not None:  # the directory forgets our L2
            self._l2_reporter.close()
            self._l2_reporter = None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work.take_failed_blocks() if self._worker is not None else set()

    def get_kv_connector_stats(self) -> KvtierStats | None:
        """A worker's copies since the last call; the scheduler side's requests it could not
        key (vLLM adds both up)."""
        if self._scheduler is not None:
            unkeyed = self._scheduler.take_unkeyed()
            copies = CopyStats(unkeyed_adapter_requests=unkeyed[Unkeyed.ADAPTER],
                               unkeyed_multimodal_requests=unkeyed[Unkeyed.MULTIMODAL])
        elif self._worker is not None:
            copies = self._worker.take_stats()
        else:
            return None
        return None if copies.empty else KvtierStats(copies.to_payload())

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvtierStats:
        return KvtierStats(CopyStats.from_payload(data).to_payload())

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KvtierPromMetrics:
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def build_connector_worker_meta(self) -> KvtierWorkerMeta:
        report, self._report = self._report, WorkerReport()
        return KvtierWorkerMeta(report)

    def _bound_plan(self) -> StepPlan:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, KvtierStepMeta) else StepPlan()

    @property
    def _work(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError(f"{CONNECTOR}: vLLM ran a step before register_kv_caches")
        return self._worker
