"""What the serve graph's deployments send each other: msgpack records (`kvtier.messages`'
convention: frozen dataclasses, encoded by the sender with `to_msgpack`, decoded and checked
by the receiver with `from_msgpack`), never pickled objects or dicts keyed by convention.

- `Route`: the router's answer to `choose` (which instance, why, the pages it expects hit).
- `AnswerItem`: one item of a replica's answer stream (`kind`: more tokens, the last ones
  with how it went, or the last ones of an answer that failed by itself).
- `ReplicaPoll`: what the router's poll of a replica gets (load, epoch, cache events, steps).
- `ReplicaDescription`: a replica's page-key namespace and page size (the router hashes
  prompts with it).
- `ReplicaSnapshot`: each of a replica's instances' counters and pool use (the metrics).
- `ReplicaStorage`: the L3 a replica's instances have attached (GET /admin/storage).
- `InstanceStates`: each instance's liveness state (what answers in flight watch).
- `RouterStatus`: the router's view of every instance (GET /admin/router, /health, metrics).
- `RunningConfig`, `ReplicaConfig`: what a rank runs with, and a replica's (GET /admin/config).
- `ReplicaFlush`: the L1 pages free after a replica's flush (POST /admin/flush).

The HTTP answers built from them (`kvtier.frontend.openai_responses`, the admin endpoints) take
their fields from `to_dict()`: a record's fields as plain values (enums by value), in order.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Sequence

from kvtier.config import HiCacheConfigRecord
from kvtier.engine.request import CachedTokens, FinishReason
from kvtier.engine.sampling import TokenLogprob
from kvtier.keys import KeyNamespace
from kvtier.messages import MessageError, Record
from kvtier.policies import StorageBackendKind
from kvtier.tiers.cache_types import RequestLengths
from kvtier.frontend.liveness import InstanceState
from kvtier.frontend.router_index import Choice, ChoiceReason


@dataclass(frozen=True)
class ExpectedPages(Record):
    """Leading pages of a request the router expects the chosen instance to hit, by tier
    (`router_index.TierHits`)."""

    device_pages: int
    host_pages: int
    storage_pages: int
    peer_pages: int = 0


@dataclass(frozen=True)
class Route(Record):
    """The router's choice for a request: `instance` (None when asked to avoid some and no
    other is live and unbroken: the caller keeps waiting where it is), `reason`, `hits`."""

    instance: str | None
    reason: ChoiceReason | None = None
    hits: ExpectedPages | None = None

    @classmethod
    def of(cls, choice: Choice) -> "Route":
        return cls(choice.instance, choice.reason, ExpectedPages(*choice.hits))

    def to_field(self) -> dict:
        """`kvtier.route` of an answer: {"reason", "expected_pages"}."""
        return {"reason": None if self.reason is None else self.reason.value,
                "expected_pages": None if self.hits is None else self.hits.to_dict()}


NO_CACHED = CachedTokens(0, 0, 0)


@dataclass(frozen=True)
class PDReport(Record):
    """`kvtier.pd` of an answer in a prefill/decode graph (`openai_responses.pd_report`)."""

    mode: str
    transport: str
    prefill_instance: str
    decode_instance: str | None
    stages: dict[str, Any]  # stage -> seconds (None: it did not happen)
    transfer_bytes: int
    transfer_pages: int


@dataclass(frozen=True)
class AnswerFinal(Record):
    """How an answer's run went: its finish reason, cached tokens by tier, the five lengths,
    the instance-side TTFT and queue time, the instance; in a prefill/decode graph, `pd`."""

    finish_reason: FinishReason
    cached: CachedTokens
    lengths: RequestLengths
    ttft_s: float | None
    queue_s: float | None
    instance: str
    pd: PDReport | None = None

    @classmethod
    def of(cls, out: Any, name: str, pd: PDReport | None = None) -> "AnswerFinal":
        """From an instance's (or a prefill/decode driver's) output of a finished request."""
        return cls(out.finish_reason, CachedTokens(*out.cached), RequestLengths(*out.lengths),
                   out.ttft_s, out.queue_s, name, pd)


class AnswerItemKind(enum.Enum):
    TOKENS = "tokens"  # more of the answer
    FINAL = "final"  # its last tokens, with `final`: how it went
    ERROR = "error"  # its last tokens: this request alone failed (`error` says why)


@dataclass(frozen=True)
class AnswerItem(Record):
    """One item of an answer stream: new token ids and, when the request asked, their
    log-probabilities."""

    kind: AnswerItemKind
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None
    final: AnswerFinal | None = None
    error: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(self.tokens))
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", tuple(self.logprobs))
        if (self.final is not None) != (self.kind is AnswerItemKind.FINAL):
            raise MessageError(f"AnswerItem: a {self.kind.value} item has `final` "
                               f"{'missing' if self.final is None else 'set'}")
        if bool(self.error) != (self.kind is AnswerItemKind.ERROR):
            raise MessageError(f"AnswerItem: a {self.kind.value} item has `error` "
                               f"{'missing' if not self.error else 'set'}")

    @property
    def last(self) -> bool:
        """The answer's last item (nothing comes after it)."""
        return self.kind is not AnswerItemKind.TOKENS

    @classmethod
    def more(cls, tokens: Sequence[int],
             logprobs: Sequence[TokenLogprob] | None = None) -> "AnswerItem":
        return cls(AnswerItemKind.TOKENS, tuple(tokens),
                   None if logprobs is None else tuple(logprobs))


@dataclass(frozen=True)
class ReplicaPoll(Record):
    """What a poll of an instance's server gets (`actors/instance_server.py`), and so the
    router's poll of a replica."""

    load: int  # requests queued or running
    epoch: int  # rank-set restarts so far: a router forgets an instance whose epoch changed
    events: tuple[bytes, ...]  # CacheEventBatch msgpack records since the last poll, oldest
    # first
    broken: str | None  # why the instance stopped serving, or None
    steps: int  # steps completed so far: the router's deadline watches it grow while load > 0
    recovering: bool = False  # replacing its ranks (kvtier.frontend.liveness: RECOVERING)
    holdings: bytes | None = None  # asked for (`full`): everything it holds, one
    # CacheEventBatch at the last seq, in place of `events` (None: no events yet)


@dataclass(frozen=True)
class ReplicaDescription(Record):
    """What a replica's callers need of its cache (every instance of it is built alike): the
    page-key namespace and page size the router and the pin desk hash prompts with, the
    replica's name and TP size."""

    model: str
    tenant_salt: str
    layout_fingerprint: str
    page_size: int
    instance: str
    tp_size: int

    @classmethod
    def of(cls, desc: Any, instance: str, tp_size: int) -> "ReplicaDescription":
        """From its first instance's rank CacheDescription (`actors/rank_actor.py`)."""
        return cls(desc.model, desc.tenant_salt, desc.layout_fingerprint, desc.page_size,
                   instance, tp_size)

    @property
    def key_namespace(self) -> KeyNamespace:
        return KeyNamespace(self.model, self.tenant_salt, self.layout_fingerprint)


@dataclass(frozen=True)
class InstanceStatus(Record):
    """One instance as the router sees it: its load, rank-set epoch (None: not polled yet),
    why it is broken (if it is), requests routed to it, pages indexed, its liveness state,
    seconds since it last showed progress, its stalls."""

    name: str
    load: int
    epoch: int | None
    broken: str | None
    routed: int
    indexed_pages: int
    state: InstanceState
    quiet_s: float
    stalls: int


@dataclass(frozen=True)
class RouterStatus(Record):
    """The router's `status`: every instance, the L3 pages it indexes, its choices by
    reason (ChoiceReason value -> count)."""

    instances: tuple[InstanceStatus, ...]
    storage_pages: int
    reasons: dict[str, Any]

    def to_json(self) -> dict:
        """GET /admin/router's body: instances by name."""
        return {"instances": {i.name: {k: v for k, v in i.to_dict().items() if k != "name"}
                              for i in self.instances},
                "storage_pages": self.storage_pages, "reasons": dict(self.reasons)}

    def stalled(self) -> set[str]:
        return {i.name for i in self.instances if i.state is InstanceState.STALLED}


@dataclass(frozen=True)
class L3Attachment(Record):
    """The L3 namespace a replica's instances attached: its backend, id, backend options."""

    backend: StorageBackendKind
    namespace: str
    options: dict[str, Any]


@dataclass(frozen=True)
class ReplicaStorage(Record):
    """A replica's L3 (None: none attached): what `storage`, `attach_l3` and `detach_l3`
    answer (the admin endpoints show `to_dict()`)."""

    instance: str
    l3: L3Attachment | None


@dataclass(frozen=True)
class InstanceSnapshot(Record):
    """One instance's figures for the metrics (`kvtier.frontend.metrics`): rank 0's counters
    (its ranks mirror each other; fields of `metrics.CACHE_COUNTERS`), its L3 counters
    (None without L3; `metrics.STORAGE_COUNTERS`), L2 use, gauges, the agreement rounds'
    seconds since the last snapshot, its pins, its rank-set restarts."""

    name: str
    counters: dict[str, Any]
    storage: dict[str, Any] | None
    host_used_tokens: int
    host_total_tokens: int
    gauges: dict[str, Any]
    agreement_s: tuple[float, ...]
    pins: dict[str, Any]
    restarts: int


@dataclass(frozen=True)
class ReplicaSnapshot(Record):
    """What a replica's `snapshot` answers: each of its instances (one, or a prefill/decode
    graph's every instance by its own name)."""

    instances: tuple[InstanceSnapshot, ...]


@dataclass(frozen=True)
class NamedState(Record):
    name: str
    state: InstanceState


@dataclass(frozen=True)
class InstanceStates(Record):
    """The router's `states`: each instance's liveness state (live, stalled, recovering)."""

    states: tuple[NamedState, ...]

    def of(self, name: str) -> InstanceState:
        """`name`'s state (LIVE when the router did not say)."""
        return next((s.state for s in self.states if s.name == name), InstanceState.LIVE)


@dataclass(frozen=True)
class RunningConfig(Record):
    """What a rank runs with (`Rank.running_config`): its cache config (SGLang's knob names,
    normalized), the L3 attached through the namespace actor, the cache namespace's model
    part, the resolved dtype and the engine's scheduling choices."""

    hicache: HiCacheConfigRecord
    l3: str | None
    model: str
    dtype: str
    chunk_tokens: int
    deterministic: bool
    schedule_policy: str
    device_pages: int
    host_pages: int
    engine: str = "kvtier"  # what computes the answers (frontend.settings.EngineKind)

    def to_json(self) -> dict[str, Any]:
        """As GET /admin/config shows it: the cache's knobs as `HiCacheConfig.to_dict()`."""
        out = self.to_dict()
        out["hicache"] = {**self.hicache.knobs, "storage_options": self.hicache.storage_options}
        return out


@dataclass(frozen=True)
class ReplicaConfig(Record):
    """What a replica's `config` answers: its ranks' running config (rank 0 speaks for them:
    they are built from the same settings) and, for a prefill/decode graph, its layout."""

    instance: str
    running: RunningConfig
    prefill_instances: tuple[str, ...] = ()
    decode_instances: tuple[str, ...] = ()
    pd_transport: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"instance": self.instance, **self.running.to_json()}
        if self.pd_transport is not None:
            out.update(prefill_instances=list(self.prefill_instances),
                       decode_instances=list(self.decode_instances),
                       pd_transport=self.pd_transport)
        return out


@dataclass(frozen=True)
class ReplicaFlush(Record):
    """What a replica's `flush` answers: its L1 pages free after dropping every unlocked L1 and
    L2 page; a prefill/decode graph's per instance (`per_instance`)."""

    instance: str
    free_device_pages: int
    per_instance: dict[str, int] | None = None

    def to_json(self) -> dict[str, Any]:
        free = self.free_device_pages if self.per_instance is None else dict(self.per_instance)
        return {"instance": self.instance, "free_device_pages": free}
