"""`kvtier bench soak --tp N --instances M --l3 file|mooncake|nixl
[--model tiny|smollm2|DIR|FILE.gguf]`: the soak on the actor system.

M instances of N rank actors each share one L3 namespace (the namespace actor, its page
directory, the chosen backend) on a local Ray cluster pinned to 127.0.0.1. Every instance
keeps a few requests in flight over shared documents (so the instances write the same pages,
and pages get published between one rank's lookup and another's), aborts a share of them, and
now and then drops its L1 and L2 so the next hits come from L3. Every `--fault-every` seconds
one fault is armed: an L3 read that fails, hangs (released after a second), tears or stops
half way, a write that fails or stops half way, one rank's directory lookups failing, a
corrupted object (file and nixl), a rank process killed, or the namespace actor killed.
Every answer is judged against the answer of a cold instance (same TP size, nothing cached,
computed with its top two log-probabilities; `kvtier.bench.answer_check`): one that first
differs where the cold answer's two most likely tokens nearly tie is a near-tie (batching
decided it), not wrong KV.

JSON: `sent`, `answered`, `aborted`, `wrong` (answers that differ where the cold answer was
sure: real errors), `near_ties`, `hangs` (requests past their deadline), `divergences`,
`rank_restarts`, `leaked_pages`, `leaked_locks` (summed over every rank), `faults_injected`,
plus `faults_hit`, `storage_hit_tokens`, `duration_s` and the settings. The exit code is
non-zero only for real errors: a wrong answer, a hang, a leak, a request neither answered nor
aborted.
"""
from __future__ import annotations

import logging
import os
import random
import tempfile
import time
import uuid
from typing import Any, NamedTuple

from kvtier.bench.answer_check import REFERENCE_LOGPROBS, AnswerTally, Reference, answer_words

log = logging.getLogger(__name__)

STORAGE_FAULTS = (("get", "error"), ("get", "hang"), ("get", "torn"), ("get", "partial"),
                  ("set", "error"), ("set", "partial"))
OTHER_FAULTS = ("lookup", "corrupt", "kill_rank", "kill_namespace")
HANG_RELEASE_S = 1.0


class ActorSoakParams(NamedTuple):
    tp: int = 3
    instances: int = 2
    l3: str = "file"
    model: str = "smollm2"  # or tiny, a Hugging Face model directory or a GGUF file
    seconds: float = 60.0
    max_requests: int = 100_000
    fault_every_s: float = 2.0
    abort_share: float = 0.1
    in_flight: int = 4  # requests kept in flight per instance
    deadline_s: float = 180.0  # a request unanswered after this is a hang
    seed: int = 0


class ActorSoakResult(NamedTuple):
    sent: int
    answered: int
    aborted: int
    wrong: int
    near_ties: int
    hangs: int
    divergences: int
    rank_restarts: int
    leaked_pages: int
    leaked_locks: int
    faults_injected: int
    faults_hit: int
    storage_hit_tokens: int
    duration_s: float

    @property
    def clean(self) -> bool:
        """No real error: near-ties are not errors."""
        return (self.wrong == 0 and self.hangs == 0 and self.leaked_pages == 0
                and self.leaked_locks == 0 and self.answered + self.aborted == self.sent)


class _Model(NamedTuple):
    source: Any  # a WeightSource
    page_size: int
    dtype: Any
    name: str  # the namespace's model name


def _model(name: str, seed: int) -> _Model:
    import torch

    from kvtier.engine.engine import SMOLLM2_NAMESPACE
    from kvtier.engine.weight_sources import SmolLM2Weights, TinyWeights

    # fp32 for both: the soak checks the cache, and in bf16 a decode step's logits depend on
    # which other sequences share its batch (measured: 16 of 40 SmolLM2 answers differed from
    # a batch-of-one cold run from the second token on, cache or no cache); in fp32 batching
    # moves only the last bits.
    if name == "tiny":
        return _Model(TinyWeights(seed=seed), 16, torch.float32, "tiny")
    if name == "smollm2":
        return _Model(SmolLM2Weights(), 64, torch.float32, SMOLLM2_NAMESPACE)
    from kvtier.cli.demo import demo_model

    model = demo_model(name)  # a directory or GGUF file, resolved as kvtier demo resolves it
    return _Model(model.source, 64, torch.float32, model.name)


def _prompts(rng: random.Random, page: int, vocab: int) -> list[tuple[int, ...]]:
    """Three documents x four questions, and four prompts that share nothing."""
    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    docs = [tokens(6 * page) for _ in range(3)]
    questions = [tokens(rng.randrange(3, page)) for _ in range(4)]
    return ([tuple(d + q) for d in docs for q in questions]
            + [tuple(tokens(rng.randrange(page, 4 * page))) for _ in range(4)])


class _Flight(NamedTuple):
    prompt: tuple[int, ...]
    added_s: float


class _Ledger:
    """What the soak counts, without Ray: each instance's requests in flight, the tallies, and
    every answer judged against its prompt's cold reference."""

    def __init__(self, instances: int, references: dict[tuple[int, ...], Reference]) -> None:
        self.flights: list[dict[int, _Flight]] = [{} for _ in range(instances)]
        self.references = references
        self.answers = AnswerTally()
        self.sent = self.answered = self.aborted = self.hangs = 0
        self.injected = self.hit = self.storage_hit_tokens = 0

    def send(self, k: int, req_id: int, prompt: tuple[int, ...], now_s: float) -> None:
        self.flights[k][req_id] = _Flight(prompt, now_s)
        self.sent += 1

    def abort(self, k: int, req_id: int, hung: bool = False) -> None:
        self.flights[k].pop(req_id)
        self.aborted += 1
        self.hangs += hung

    def collect(self, k: int, outs: list) -> None:
        for out in outs:
            flight = self.flights[k].pop(out.request_id, None)
            if flight is None:  # aborted by the soak already
                continue
            self.answered += 1
            self.storage_hit_tokens += out.cached.storage
            self.answers.check(out.tokens, self.references[flight.prompt],
                               f"instance {k} request {out.request_id}, {answer_words(out)}")

    def overdue(self, k: int, now_s: float, deadline_s: float) -> list[int]:
        return [r for r, f in self.flights[k].items() if now_s - f.added_s > deadline_s]


class _Soak:
    """One run's instances, traffic, faults and tallies."""

    def __init__(self, params: ActorSoakParams, tmp: str) -> None:
        from kvtier.actors.instance import Instance
        from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
        from kvtier.bench.soak_rank import SoakRank
        from kvtier.cli.demo import namespace_spec

        self.params, self.tmp = params, tmp
        self.rng = random.Random(params.seed)
        self.model = _model(params.model, params.seed)
        settings = self._settings()
        self.prompts = _prompts(self.rng, self.model.page_size,
                                self.model.source.config().vocab_size)
        self.sampling, self.reference_sampling = self._sampling()
        per_rank = 1.5 / (params.tp * (params.instances + 1))
        self.actor_name = f"kvtier-soak-{uuid.uuid4().hex[:8]}"
        self.client = get_or_create_namespace_actor(self.actor_name, f"{tmp}/state")
        spec = namespace_spec(self.model.source, settings.config, params.l3, f"{tmp}/l3",
                              self.model.name, f"soak-{uuid.uuid4().hex[:8]}",
                              dtype=self.model.dtype, page_size=self.model.page_size,
                              tp_size=params.tp, deterministic=settings.deterministic,
                              gpu=settings.gpu)
        info = self.client.register(spec)
        self.instances: list[Any] = []
        self.expected = self._cold_answers(Instance, settings, per_rank)
        for _ in range(params.instances):
            self.instances.append(Instance(
                settings._replace(l3=info, l3_actor=self.actor_name), tp_size=params.tp,
                num_cpus_per_rank=per_rank, step_timeout_s=60.0, rank_class=SoakRank))
        self.ledger = _Ledger(len(self.instances), self.expected)
        self.releases: list[tuple[float, int, int]] = []  # (when, instance, rank)

    def _settings(self):
        from kvtier.actors.rank_actor import RankSettings
        from kvtier.config import HiCacheConfig

        page = self.model.page_size
        config = HiCacheConfig.from_dict({
            "page_size": page, "hicache_ratio": 2.0, "load_back_threshold_tokens": page,
            "prefetch_policy": "timeout", "prefetch_threshold_tokens": page,
            "prefetch_timeout_base_s": 0.5, "prefetch_timeout_per_ki_token_s": 0.0,
            "prefetch_timeout_max_s": 0.5, "storage_batch_pages": 4})
        return RankSettings(self.model.source, config, device_pages=48, dtype=self.model.dtype,
                            chunk_tokens=page, timeout_s=60.0)

    def _sampling(self):
        """What the traffic asks for, and what the cold references ask for (log-probs too)."""
        from kvtier.engine.sampling import SamplingParams
        return (SamplingParams(max_new_tokens=4),
                SamplingParams(max_new_tokens=4, logprobs=REFERENCE_LOGPROBS))

    def _cold_answers(self, instance_cls, settings, per_rank: float) -> dict:
        """Each prompt once on a cold instance (same TP size), its L1/L2 dropped first."""
        expected = {}
        with instance_cls(settings, tp_size=self.params.tp,
                          num_cpus_per_rank=per_rank) as cold:
            for prompt in self.prompts:
                cold.drop_cache()
                expected[prompt] = Reference.of(
                    cold.generate([prompt], self.reference_sampling)[0])
        return expected

    # ---- traffic ---------------------------------------------------------------------------
    def run(self) -> ActorSoakResult:
        p = self.params
        start = time.monotonic()
        next_fault = start + p.fault_every_s
        while time.monotonic() - start < p.seconds and self.ledger.sent < p.max_requests:
            for k, inst in enumerate(self.instances):
                self._traffic(k, inst)
            now = time.monotonic()
            if now >= next_fault:
                self._fault()
                next_fault += p.fault_every_s
            self._release_due(now)
        self._finish(time.monotonic() + p.deadline_s)
        return self._result(time.monotonic() - start)

    def _traffic(self, k: int, inst: Any) -> None:
        flights = self.ledger.flights[k]
        while len(flights) < self.params.in_flight:
            prompt = self.rng.choice(self.prompts)
            self.ledger.send(k, inst.add_request(prompt, self.sampling), prompt,
                             time.monotonic())
        if self.rng.random() < self.params.abort_share / 4:
            victim = self.rng.choice(list(flights))
            if inst.abort(victim) is not None:
                self.ledger.abort(k, victim)
        if self.rng.random() < 0.05:
            inst.drop_cache()  # L1 and L2 forget: the next hits come from L3
        self.ledger.collect(k, inst.step())
        self._expire(k, inst)

    def _expire(self, k: int, inst: Any, deadline_s: float | None = None) -> None:
        """Abort, counted as hung, what `k` has had in flight for over `deadline_s`."""
        limit = self.params.deadline_s if deadline_s is None else deadline_s
        for req_id in self.ledger.overdue(k, time.monotonic(), limit):
            inst.abort(req_id)
            self.ledger.abort(k, req_id, hung=True)

    def _finish(self, deadline: float) -> None:
        """Answer (or, past the deadline, count as hung) what is still in flight."""
        for k, inst in enumerate(self.instances):
            self._release_due(float("inf"))
            while self.ledger.flights[k] and time.monotonic() < deadline:
                self.ledger.collect(k, inst.step())
                self._release_due(time.monotonic())
            self._expire(k, inst, deadline_s=-1.0)  # whatever is left

    # ---- faults ----------------------------------------------------------------------------
    def _fault(self) -> None:
        k = self.rng.randrange(len(self.instances))
        inst, rank = self.instances[k], self.rng.randrange(self.params.tp)
        kinds = list(STORAGE_FAULTS) + list(OTHER_FAULTS)
        kind = self.rng.choice(kinds)
        log.warning("soak: fault %s on instance %d rank %d", kind, k, rank)
        if kind == "lookup":
            armed = inst.on_rank(rank, lambda a: a.fail_lookups.remote(2))
        elif kind == "corrupt":
            armed = self._corrupt()
        elif kind == "kill_rank":
            self._count_hits(inst)  # a replaced rank's counters go with it
            inst.kill_rank(rank)
            armed = True
        elif kind == "kill_namespace":
            self.client.kill()
            armed = True
        else:
            op, how = kind
            armed = inst.on_rank(rank, lambda a: a.inject.remote(op, how, 1))
            if how == "hang":
                self.releases.append((time.monotonic() + HANG_RELEASE_S, k, rank))
        self.ledger.injected += int(bool(armed))

    def _corrupt(self) -> bool:
        """Flip a byte in the middle of one stored object (file and nixl keep files)."""
        root = os.path.join(self.tmp, "l3")
        files = [os.path.join(d, f) for d, _, names in os.walk(root) for f in names
                 if not f.startswith(".")]
        if not files:
            return False
        path = self.rng.choice(files)
        try:
            with open(path, "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(size // 2)
                byte = f.read(1)
                f.seek(size // 2)
                f.write(bytes([byte[0] ^ 0xFF]) if byte else b"\0")
        except OSError:
            return False
        return True

    def _count_hits(self, inst: Any) -> None:
        """Add the faults `inst`'s ranks have hit so far to the tally (and reset them)."""
        for rank in range(self.params.tp):
            try:
                self.ledger.hit += inst.on_rank(rank, lambda a: a.take_faults_hit.remote())
            except Exception as exc:  # noqa: BLE001 - a dead rank's count is lost
                log.info("counting faults on rank %d: %s", rank, exc)

    def _release_due(self, now: float) -> None:
        due = [r for r in self.releases if r[0] <= now]
        self.releases = [r for r in self.releases if r[0] > now]
        for _, k, rank in due:
            try:
                self.instances[k].on_rank(rank, lambda a: a.release_hangs.remote())
            except Exception as exc:  # noqa: BLE001 - a rank replaced meanwhile has no hang
                log.info("releasing hangs on instance %d rank %d: %s", k, rank, exc)

    # ---- the end ---------------------------------------------------------------------------
    def _result(self, duration_s: float) -> ActorSoakResult:
        leaked_pages = leaked_locks = 0
        for inst in self.instances:
            self._count_hits(inst)
            for rank in range(self.params.tp):
                inst.on_rank(rank, lambda a: a.release_hangs.remote())
            for audit in inst.rank_group.audit():
                leaked_pages += audit.leaked_pages + audit.orphaned_host_pages
                leaked_locks += audit.locked_nodes + audit.protected_nodes
        t = self.ledger
        return ActorSoakResult(
            t.sent, t.answered, t.aborted, t.answers.wrong, t.answers.near_ties, t.hangs,
            sum(i.divergences for i in self.instances), sum(i.restarts for i in self.instances),
            leaked_pages, leaked_locks, t.injected, t.hit, t.storage_hit_tokens,
            round(duration_s, 2))

    def close(self) -> None:
        for inst in self.instances:
            inst.close()
        self.instances = []
        self.client.shutdown()  # stops a Mooncake master it started


def run(params: ActorSoakParams = ActorSoakParams()) -> ActorSoakResult:
    from kvtier.actors.ray_env import shutdown_local_ray, start_local_ray

    start_local_ray(num_cpus=2)
    try:
        with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as tmp:
            soak = _Soak(params, tmp)
            try:
                return soak.run()
            finally:
                soak.close()
    finally:
        shutdown_local_ray()
