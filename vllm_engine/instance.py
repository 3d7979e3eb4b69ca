"""One serving instance that is one vLLM engine with KvtierConnector (docs/vllm.md): what an
`InstanceServer` (actors/instance_server) drives when the serve graph runs `engine: vllm`.

The server drives it as it drives kvtier's own instance: from one thread, a step at a time;
requests are added under the server's ids; each step reports every running request's new
tokens once (a `Progress`) and the finished requests as `Output`s. vLLM's synchronous
client (`LLMEngine`: the same EngineCore process and TP workers as `AsyncLLM`, without an
asyncio loop) fits that loop. vLLM's prefix cache is L1; the connector's L2 and L3 say what
they supplied to each request in the `kv_transfer_params` its last output carries
(`CachedBySource`), so an answer reports its cached tokens by tier as kvtier's engine does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Sequence

from kvtier.actors.instance import InstanceStep
from kvtier.actors.step_wire import Progress
from kvtier.config import CONNECTOR_PEER_KEY, connector_key
from kvtier.engine.request import CachedTokens, FinishReason, Output, Resume
from kvtier.engine.sampling import SamplingParams, TokenLogprob
from kvtier.errors import ConfigError
from kvtier.frontend.cache_events import CacheEventLog
from kvtier.keys import KeyNamespace
from kvtier.tiers.cache_types import CacheCounters, RequestLengths
from kvtier.tiers.controller import TransferStats
from kvtier.tiers.storage_types import StorageCounters
from kvtier.vllm_engine.cached import CachedBySource
from kvtier.vllm_engine.copy_stats import CopyStats
from kvtier.vllm_engine.engine_watch import EngineWatch
from kvtier.vllm_engine.seed_gate import Pending, SeedGate, seeds_need_a_gate
from kvtier.vllm_engine.kv_events import EventFeed, KeyTranslator

CONNECTOR = "KvtierConnector"
HIT_FIRST = "kvtier.connector.vllm_scheduler.KvtierScheduler"


class VllmSettings(NamedTuple):
    """One engine: its Hugging Face model directory and sizes; `connector`: KvtierConnector's
    `kv_connector_extra_config` (docs/vllm.md), or None for vLLM alone."""

    model_dir: str
    block_size: int = 64
    kv_cache_bytes: int = 256 << 20
    max_model_len: int = 4096
    max_num_seqs: int = 8
    tp_size: int = 1
    connector: dict[str, Any] | None = None
    engine_id: str | None = None  # vLLM's (None: a new uuid): the L3 directory lists the
    # connector's L2 under it
    batched_tokens: int | None = None  # most tokens a step computes (None: vLLM's default)
    hit_first: bool = False  # vLLM's scheduler with kvtier's hit-first admission
    dtype: str = "auto"  # vLLM's model dtype ("auto": the checkpoint's; "float32", "bfloat16")

    def engine_args(self, events_endpoint: str | None = None) -> Any:
        """vLLM's arguments; `events_endpoint`: where it publishes its KV events (none: it
        publishes none)."""
        from vllm.config import KVEventsConfig, KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs

        transfer = None if self.connector is None else KVTransferConfig(
            kv_connector=CONNECTOR, kv_role="kv_both", engine_id=self.engine_id,
            kv_connector_extra_config=dict(self.connector))
        events = None if events_endpoint is None else KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=events_endpoint)
        return EngineArgs(model=self.model_dir, enforce_eager=True, enable_prefix_caching=True,
                          block_size=self.block_size, kv_cache_memory_bytes=self.kv_cache_bytes,
                          max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                          tensor_parallel_size=self.tp_size, kv_transfer_config=transfer,
                          kv_events_config=events, max_num_batched_tokens=self.batched_tokens,
                          scheduler_cls=HIT_FIRST if self.hit_first else None, dtype=self.dtype)


def vllm_sampling(sampling: SamplingParams, already: int, vocab_size: int | None = None) -> Any:
    """vLLM's parameters for kvtier's, `already` answer tokens in (a resumed request). Stop
    ids past the model's `vocab_size` are left out: no answer token can be one (kvtier's
    engine ignores them alike), and vLLM would refuse the request."""
    from vllm import SamplingParams as VllmSampling
    from vllm.sampling_params import RequestOutputKind

    left = sampling.max_new_tokens - already
    if left < 1:
        raise ConfigError(f"a request resumed after {already} tokens has none left of its "
                          f"max_new_tokens={sampling.max_new_tokens}")
    stops = sampling.stop_token_ids
    if stops is not None and vocab_size is not None:
        stops = tuple(t for t in stops if t < vocab_size)
    return VllmSampling(
        max_tokens=left, temperature=sampling.temperature, top_p=sampling.top_p,
        top_k=sampling.top_k, min_p=sampling.min_p, seed=sampling.seed,
        repetition_penalty=sampling.repetition_penalty,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty, logprobs=sampling.logprobs,
        # kvtier's stop ids are the whole set (with EOS when EOS ends the answer)
        stop_token_ids=None if stops is None else list(stops), ignore_eos=stops is not None,
        output_kind=RequestOutputKind.DELTA, detokenize=False)


FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH,
          "abort": FinishReason.ABORTED, "error": FinishReason.ERROR}


def token_logprobs(tokens: Sequence[int], entries: Sequence[dict] | None, k: int
                   ) -> tuple[TokenLogprob, ...] | None:
    """kvtier's log-probabilities from vLLM's (one {token: Logprob} per chosen token: the
    chosen one and the `k` most likely)."""
    if entries is None:
        return None
    out = []
    for token, entry in zip(tokens, entries):
        top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= k),
                     key=lambda item: item[1].rank)
        out.append(TokenLogprob(int(token), float(entry[token].logprob),
                                tuple((int(t), float(lp.logprob)) for t, lp in top)))
    return tuple(out)


class VllmCounters(NamedTuple):
    """An engine's figures for kvtier's metrics (`InstanceSnapshot`): fields of CacheCounters
    and TransferStats, and of StorageCounters (None: no L3), from its requests' outputs and
    the connector's copies."""

    cache: dict[str, Any]
    storage: dict[str, Any] | None


def _copy_tally(tally: Callable[[dict[str, Any]], None],
                usage: Callable[[float], None]) -> Any:
    """A vLLM stat logger class that hands each step's connector figures to `tally` and the
    share of KV blocks in use to `usage`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ConnectorTally(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            if scheduler_stats is None:
                return
            usage(float(scheduler_stats.kv_cache_usage))
            payload = scheduler_stats.kv_connector_stats
            if payload:
                tally(payload)

        def log_engine_initialized(self) -> None:
            pass

    return ConnectorTally


class EngineAudit(NamedTuple):
    """What a vLLM engine holds once its instance runs no request (`VllmInstance.audit`)."""

    idle: bool  # no request was running (False: nothing else was checked)
    blocks_in_use: int  # KV blocks vLLM still holds for some request: leaked, once idle


class EngineFacts(NamedTuple):
    """What a vLLM engine runs with (`VllmInstance.facts`)."""

    blocks: int  # KV blocks: its L1
    dtype: str  # the model's, resolved (bfloat16, float32, ...)
    batched_tokens: int  # most tokens one step computes (vLLM's max_num_batched_tokens)


def vllm_request_id(request_id: int, label: str) -> str:
    """A request's id in vLLM: its client's id (`label`, the OpenAI id: vLLM's logs and
    the connector's then name it so) and the server's, which makes it unique (one request
    may be sent again to the same instance)."""
    return f"{label}@{request_id}" if label else str(request_id)


def server_request_id(vllm_id: str) -> int:
    """The server's id in a vLLM request id (`vllm_request_id`)."""
    return int(vllm_id.rpartition("@")[2])


@dataclass
class _Running:
    prompt: tuple[int, ...]
    sampling: SamplingParams
    resumed: tuple[int, ...]  # answer tokens the caller had before this run
    resumed_logprobs: tuple[TokenLogprob, ...] | None
    arrived: float  # monotonic
    vllm_id: str  # its request id in vLLM (vllm_request_id)
    answer: list[int] = field(default_factory=list)  # this run's tokens
    logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token: float | None = None
    last_token: float | None = None


class VllmInstance:
    """A `DrivenInstance` (actors/instance_server) over one vLLM engine. `event_keys`: the
    router's key namespace; with it the engine publishes its KV events and the instance
    reports them as cache events once watched (vllm_engine/kv_events.py)."""

    def __init__(self, settings: VllmSettings, event_keys: KeyNamespace | None = None) -> None:
        from vllm.v1.engine.llm_engine import LLMEngine

        self.settings = settings
        self._l3 = settings.connector is not None and \
            bool(settings.connector.get(connector_key("storage_backend")))  # connector's L3
        self._peers = settings.connector is not None and \
            bool(settings.connector.get(CONNECTOR_PEER_KEY))  # its peer-to-peer L2
        self._event_keys = event_keys
        self._feed = None if event_keys is None else EventFeed()
        self._translator: KeyTranslator | None = None
        endpoint = None if self._feed is None else self._feed.endpoint
        self._copies = CopyStats()  # what the connector's workers copied (vLLM's stats)
        self._hits = CachedTokens(0, 0, 0)  # finished requests' cached prompt tokens by tier
        self._lookups = 0  # finished requests
        self._usage = 0.0  # share of KV blocks in use after the last step vLLM reported
        loggers = [_copy_tally(self._tally, self._used)]
        try:
            self._engine = LLMEngine.from_engine_args(settings.engine_args(endpoint),
                                                      stat_loggers=loggers)
        except BaseException:
            if self._feed is not None:
                self._feed.close()
            raise
        self._vocab_size = self._engine.vllm_config.model_config.get_vocab_size()
        # seeded requests prefilled in one step on vLLM's CPU build (vllm_engine/seed_gate.py)
        self._gate = SeedGate(self.facts().batched_tokens, seeds_need_a_gate())
        self._watch = EngineWatch(self._engine.engine_core)  # a dead engine fails its step
        self._running: dict[int, _Running] = {}
        self._refused: dict[int, Output] = {}  # requests vLLM would not take, answered next step

    # ---- DrivenInstance ---------------------------------------------------------------------
    events_when_idle = True  # vLLM publishes a step's KV events after the step, from its
    # EngineCore process: the last ones arrive when no request runs

    @property
    def restarts(self) -> int:
        return 0  # vLLM does not replace its workers: a dead engine stops the instance

    @property
    def recovering(self) -> bool:
        return False

    @property
    def num_pending(self) -> int:
        return len(self._running) + len(self._refused) + len(self._gate)

    def watch_cache(self, name: str) -> None:
        """Report cache events under `name` (none without `event_keys`: the engine
        publishes none)."""
        if self._event_keys is None:
            return
        self._translator = KeyTranslator(self._event_keys, self.settings.block_size,
                                         CacheEventLog(name))

    def drain_events(self) -> bytes | None:
        if self._feed is None:
            return None
        batches = self._feed.take()
        if self._translator is None:
            return None  # not watched: nobody wants them
        for batch in batches:
            self._translator.feed(batch)
        drained = self._translator.log.drain()
        return None if drained is None else drained.to_msgpack()

    def add_request(self, tokens: Sequence[int], sampling: SamplingParams,
                    cache_salt: str = "", resume: Resume | None = None,
                    request_id: int | None = None, label: str = "") -> int:
        if request_id is None:
            raise ValueError("a vLLM instance takes its requests under the server's ids")
        pending = self._gate.admit(Pending(request_id, tuple(tokens), sampling, cache_salt,
                                           resume, time.monotonic(), label))
        if pending is not None:
            self._add(pending)
        return request_id

    def _add(self, pending: Pending) -> None:
        """`pending` to vLLM now; one vLLM refuses (too long, bad parameters) fails alone."""
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        request_id, tokens, sampling, cache_salt, resume, arrived, label = pending
        resumed = () if resume is None else tuple(resume.tokens)
        prompt = TokensPrompt(prompt_token_ids=[*tokens, *resumed])
        if cache_salt:
            prompt["cache_salt"] = cache_salt
        vllm_id = vllm_request_id(request_id, label)
        try:
            self._engine.add_request(vllm_id, prompt,
                                     vllm_sampling(sampling, len(resumed), self._vocab_size))
        except (VLLMClientError, ValueError, TypeError, ConfigError) as exc:
            self._refused[request_id] = Output(
                request_id, tuple(tokens), resumed, None, FinishReason.ERROR,
                RequestLengths(0, 0, 0, 0, 0), CachedTokens(0, 0, 0), None, None,
                error=f"vLLM refused the request: {exc}")
            return
        self._running[request_id] = _Running(
            tuple(tokens), sampling, resumed, None if resume is None else resume.logprobs,
            arrived, vllm_id)

    def abort(self, request_id: int) -> object:
        self._refused.pop(request_id, None)
        if self._gate.drop(request_id):
            return None
        running = self._running.pop(request_id, None)
        if running is not None:
            self._engine.abort_request([running.vllm_id])
        return None

    def step_report(self) -> InstanceStep:
        prefilling = [i for i, r in self._running.items() if r.first_token is None]
        for pending in self._gate.release(prefilling, len(self._running)):
            self._add(pending)
        finished: list[Output] = list(self._refused.values())
        self._refused.clear()
        outputs = self._engine.step() if self._running else []
        now = time.monotonic()
        progress: dict[int, Progress] = {}
        for out in outputs:
            request_id = server_request_id(out.request_id)
            req = self._running.get(request_id)
            if req is None:
                continue  # aborted meanwhile
            (completion,) = out.outputs
            new = tuple(int(t) for t in completion.token_ids)
            lps = token_logprobs(new, completion.logprobs, req.sampling.logprobs or 0)
            if new:
                start = len(req.resumed) + len(req.answer)
                req.answer.extend(new)
                req.logprobs.extend(lps or ())
                req.first_token = req.first_token or now
                req.last_token = now
                progress[request_id] = Progress(start, new, lps)
            if out.finished:
                del self._running[request_id]
                finished.append(self._output(request_id, req, out, completion))
        return InstanceStep(finished, progress, self.drain_events())

    def close(self) -> None:
        self._watch.close()
        try:
            self._engine.engine_core.shutdown()
        finally:
            if self._feed is not None:
                self._feed.close()

    # ---- maintenance (between steps) --------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """vLLM's KV blocks (its L1), as its engine sized them."""
        return int(self._engine.vllm_config.cache_config.num_gpu_blocks or 0)

    def facts(self) -> "EngineFacts":
        """What the engine runs with, as vLLM resolved it."""
        config = self._engine.vllm_config
        dtype = str(config.model_config.dtype).removeprefix("torch.")
        return EngineFacts(self.num_blocks, dtype,
                           int(config.scheduler_config.max_num_batched_tokens))

    def drop_cache(self) -> int | None:
        """Drop vLLM's prefix cache (L1); the connector's L2 and L3 keep their pages. The
        blocks free now (all of them), or None: vLLM refused (requests are running)."""
        if not self._engine.reset_prefix_cache():
            return None
        return self.num_blocks

    def audit(self) -> EngineAudit:
        """Whether vLLM still holds KV blocks with no request running: it drops its prefix
        cache (L1), which it refuses while any block is in use; how many then are from its
        last step's figures (at least 1)."""
        if self.num_pending:
            return EngineAudit(False, 0)
        if self._engine.reset_prefix_cache():
            return EngineAudit(True, 0)
        return EngineAudit(True, max(1, round(self._usage * max(self.num_blocks - 1, 1))))

    def counters(self) -> "VllmCounters":
        """kvtier's cache and L3 counters of this engine so far (monotonic)."""
        copies, hits = self._copies, self._hits
        cache = {**CacheCounters(
            lookups=self._lookups, device_hit_tokens=hits.device, host_hit_tokens=hits.host,
            loaded_back_tokens=copies.hit_tokens + copies.l3_hit_tokens + copies.peer_hit_tokens,
            backed_up_tokens=copies.backup_tokens,
            failed_load_tokens=copies.failed_load_tokens).snapshot(),
            **TransferStats(write_bytes=copies.backup_bytes, write_s=copies.backup_seconds,
                            load_bytes=copies.load_back_bytes,
                            load_s=copies.load_back_seconds)._asdict()}
        storage = StorageCounters(storage_hit_tokens=hits.storage,
                                  prefetched_tokens=copies.l3_hit_tokens
                                  + copies.peer_hit_tokens,
                                  peer_prefetched_tokens=copies.peer_hit_tokens).snapshot()
        return VllmCounters(cache, storage if self._l3 or self._peers else None)

    def _used(self, share: float) -> None:
        self._usage = share

    def _tally(self, payload: dict[str, Any]) -> None:
        """One step's connector figures, as vLLM's stats carry them (its step thread)."""
        self._copies = self._copies + CopyStats.from_payload(payload)

    # ---- answers ----------------------------------------------------------------------------
    def _output(self, request_id: int, req: _Running, out: Any, completion: Any) -> Output:
        prompt_len = len(req.prompt) + len(req.resumed)
        planned = CachedBySource.of(out.kv_transfer_params)
        # vLLM counts its own prefix hit and every token it planned to take from the
        # connector; what the connector really loaded is reported, never the plan
        local = max(0, int(out.num_cached_tokens or 0) - planned.planned)
        by_source = planned.loaded()
        fetched = by_source.storage + by_source.peer  # read into L2 for it, then loaded
        cached = CachedTokens(local, by_source.host, by_source.storage, by_source.peer)
        total = local + by_source.planned
        from_host = by_source.host + fetched
        self._lookups += 1
        self._hits = CachedTokens(*(a + b for a, b in zip(self._hits, cached)))
        lengths = RequestLengths(cached.device, from_host, from_host, fetched,
                                 prompt_len - total)
        reason = FINISH.get(str(completion.finish_reason), FinishReason.ERROR)
        logprobs = None
        if req.sampling.logprobs is not None:
            logprobs = (*(req.resumed_logprobs or ()), *req.logprobs)
        decoded = len(req.answer) - 1
        rate = None
        if decoded > 0 and req.last_token > req.first_token:
            rate = decoded / (req.last_token - req.first_token)
        return Output(request_id, req.prompt, (*req.resumed, *req.answer), None, reason,
                      lengths, cached,
                      None if req.first_token is None else req.first_token - req.arrived,
                      rate, logprobs=logprobs,
                      error=None if reason is not FinishReason.ERROR
                      else f"vLLM finished the request with {completion.finish_reason!r}")
