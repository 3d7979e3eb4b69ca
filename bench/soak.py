"""`kvtier bench soak`: mixed traffic with random aborts and an L3 fault every few seconds,
bounded in time and count; every answer is checked, and the pools must come back clean.

    kvtier bench soak --minutes 2 --json
    kvtier bench soak --tp 3 --instances 2 --l3 file --minutes 3 --json   (bench.actor_soak)

Without --tp/--instances: one engine (the tiny model by default: random weights, fast enough that the cache, not the
model, is what runs) over L1, L2 and a `file` L3 behind `FaultyBackend`. Traffic mixes a
shared system prompt, questions about a few documents, and prompts with no reuse; a share of
requests is aborted at a random step; every `--fault-every` seconds one fault is armed (an
error, a delay, a partial write, a torn read, or a hang released after a second) and now and
then L1 and L2 are flushed so requests come from L3. Every finished answer is judged against
the same prompt's answer from a reference engine without any cache tier below L1 (greedy,
computed with its top two log-probabilities; `kvtier.bench.answer_check`): batching decides
a token where the model's two most likely tokens nearly tie, so an answer that first differs
there is a near-tie, not wrong KV.

JSON contract: `sent`, `answered`, `wrong` (answers that differ from the reference where it
was sure: real errors), `near_ties` (answers that first differ at a near-tie of the
reference's top two), `leaked_pages`, `leaked_locks`, `faults_injected`, `rss_growth_mb`
(plus `aborted`, `storage_hits`, `duration_s`). The exit code is non-zero only for real
errors: a wrong answer, a leaked page or lock, a request neither answered nor aborted.
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from typing import NamedTuple

import torch

from kvtier.backends.base import StorageTarget
from kvtier.backends.faulty import FaultKind, FaultyBackend, StorageOp
from kvtier.backends.registry import create_backend
from kvtier.bench.answer_check import (REFERENCE_LOGPROBS, AnswerTally, Reference,
                                       answer_words)
from kvtier.cli.shared_flags import add_l3_flag, add_model_flag, add_tp_flag
from kvtier.config import HiCacheConfig
from kvtier.policies import StorageBackendKind
from kvtier.engine import Engine, SamplingParams
from kvtier.engine.loader import load_tiny_model
from kvtier.engine.request import FinishReason
from kvtier.tiers.hierarchical_cache import HierarchicalCache

PAGE = 16
PARAMS = SamplingParams(max_new_tokens=4)
REFERENCE_PARAMS = SamplingParams(max_new_tokens=4, logprobs=REFERENCE_LOGPROBS)
FAULTS = ((StorageOp.GET, FaultKind.ERROR), (StorageOp.GET, FaultKind.DELAY),
          (StorageOp.GET, FaultKind.TORN), (StorageOp.GET, FaultKind.PARTIAL),
          (StorageOp.GET, FaultKind.HANG), (StorageOp.SET, FaultKind.ERROR),
          (StorageOp.SET, FaultKind.PARTIAL), (StorageOp.EXISTS, FaultKind.ERROR))


class SoakParams(NamedTuple):
    seconds: float = 60.0
    max_requests: int = 100_000
    fault_every_s: float = 2.0
    abort_share: float = 0.1
    batch: int = 6  # requests added at a time
    seed: int = 0


class SoakResult(NamedTuple):
    sent: int
    answered: int
    aborted: int
    wrong: int
    near_ties: int
    leaked_pages: int
    leaked_locks: int
    faults_injected: int
    storage_hits: int
    rss_growth_mb: float
    duration_s: float

    @property
    def clean(self) -> bool:
        """No real error: near-ties are not errors."""
        return (self.wrong == 0 and self.leaked_pages == 0 and self.leaked_locks == 0
                and self.answered + self.aborted == self.sent)

    def to_json(self) -> dict:
        out = self._asdict()
        out["rss_growth_mb"] = round(self.rss_growth_mb, 2)
        out["duration_s"] = round(self.duration_s, 2)
        return out


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _Traffic:
    """Prompts of three kinds, reproducible from a seed."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.system = self._tokens(4 * PAGE)
        self.docs = [self._tokens(8 * PAGE) for _ in range(4)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(1, 256) for _ in range(n)]

    def prompt(self) -> tuple[int, ...]:
        kind = self.rng.random()
        if kind < 0.4:
            return tuple(self.system + self._tokens(self.rng.randrange(3, 20)))
        if kind < 0.8:
            return tuple(self.rng.choice(self.docs) + self._tokens(self.rng.randrange(3, 9)))
        return tuple(self._tokens(self.rng.randrange(20, 90)))


def _config() -> HiCacheConfig:
    return HiCacheConfig.from_dict({
        "page_size": PAGE, "hicache_ratio": 2.0, "load_back_threshold_tokens": PAGE,
        "prefetch_policy": "timeout", "prefetch_threshold_tokens": PAGE,
        "prefetch_timeout_base_s": 0.2, "prefetch_timeout_per_ki_token_s": 0.0,
        "prefetch_timeout_max_s": 0.2, "storage_batch_pages": 4})


def leaks(cache: HierarchicalCache) -> tuple[int, int]:
    """(pages held outside the tree, nodes still locked) once every request has ended."""
    cache.quiesce()
    audit = cache.audit()
    return audit.leaked_pages + audit.orphaned_host_pages, audit.leaked_locks


def reference_answer(engine: Engine, prompt: tuple[int, ...]) -> Reference:
    """`prompt` alone on the reference engine, with the log-probabilities a judge needs."""
    return Reference.of(engine.generate([prompt], REFERENCE_PARAMS)[0])


def run(params: SoakParams = SoakParams(), progress: bool = False) -> SoakResult:
    torch.manual_seed(params.seed)
    rng = random.Random(params.seed)
    model = load_tiny_model(torch.float32, "cpu")
    reference = Engine(model, HierarchicalCache(
        HiCacheConfig(page_size=PAGE, enable_hierarchical_cache=False), model.kv_spec(PAGE),
        256, device="cpu", model="tiny"), owns_cache=True)
    expected: dict[tuple[int, ...], Reference] = {}
    tally = AnswerTally()
    traffic = _Traffic(rng)
    with tempfile.TemporaryDirectory(prefix="kvtier-soak-") as root:
        cache = HierarchicalCache(_config(), model.kv_spec(PAGE), 48, device="cpu",
                                  model="tiny")
        faulty = FaultyBackend(create_backend("file", StorageTarget(cache.namespace, cache.heads),
                                              {"root_dir": root}), seed=params.seed)
        cache.attach_storage(faulty)
        engine = Engine(model, cache)
        sent = answered = aborted = storage_hits = 0
        prompts: dict[int, tuple[int, ...]] = {}
        rss0 = _rss_mb()
        start = time.monotonic()
        next_fault = start + params.fault_every_s
        releases: list[threading.Timer] = []
        try:
            while time.monotonic() - start < params.seconds and sent < params.max_requests:
                if len(prompts) < params.batch:
                    for _ in range(params.batch):
                        p = traffic.prompt()
                        prompts[engine.add_request(p, PARAMS)] = p
                        sent += 1
                if time.monotonic() >= next_fault:
                    op, kind = rng.choice(FAULTS)
                    faulty.inject(op, kind, times=1, delay_s=0.3)
                    if kind is FaultKind.HANG:
                        timer = threading.Timer(1.0, faulty.release)
                        timer.start()
                        releases.append(timer)
                    if rng.random() < 0.5:  # L1 and L2 forget: the next hits come from L3
                        cache.drop_unlocked()
                    next_fault += params.fault_every_s
                if prompts and rng.random() < params.abort_share / 4:
                    victim = rng.choice(list(prompts))
                    if engine.abort(victim) is not None:
                        prompts.pop(victim)
                        aborted += 1
                for out in engine.step():
                    prompt = prompts.pop(out.request_id)
                    if out.finish_reason is FinishReason.ABORTED:
                        aborted += 1
                        continue
                    answered += 1
                    storage_hits += out.cached.storage > 0
                    if prompt not in expected:
                        expected[prompt] = reference_answer(reference, prompt)
                    tally.check(out.tokens, expected[prompt], answer_words(out))
            for req_id in list(prompts):  # the deadline: abort what is left
                if engine.abort(req_id) is not None:
                    aborted += 1
                prompts.pop(req_id)
        finally:
            for timer in releases:
                timer.cancel()
            faulty.clear()
        leaked_pages, leaked_locks = leaks(cache)
        result = SoakResult(sent, answered, aborted, tally.wrong, tally.near_ties,
                            leaked_pages, leaked_locks,
                            faulty.faults.total, storage_hits, _rss_mb() - rss0,
                            time.monotonic() - start)
        engine.close()
        cache.close()
    reference.close()
    return result


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=1.0, help="how long (bounded; default 1)")
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--fault-every", type=float, default=2.0, help="seconds between faults")
    p.add_argument("--seed", type=int, default=0)
    add_tp_flag(p, None, "given: run on the actor system; tiny: 1, 2, 3, 6")
    p.add_argument("--instances", type=int, default=None,
                   help="run on the actor system: instances sharing one L3 namespace")
    add_l3_flag(p, StorageBackendKind.FILE.value, note="; the actor system's")
    add_model_flag(p, note="; the model the actor system's ranks run")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def main(ns: argparse.Namespace) -> int:
    if not 0 < ns.minutes <= 24 * 60:
        from kvtier.errors import ConfigError
        raise ConfigError(f"--minutes must be in (0, 1440], got {ns.minutes}")
    if ns.tp is not None or ns.instances is not None:
        return _main_on_actors(ns)
    result = run(SoakParams(seconds=60 * ns.minutes, max_requests=ns.max_requests,
                            fault_every_s=ns.fault_every, seed=ns.seed))
    print(json.dumps({"benchmark": "soak", **result.to_json()}))
    return 0 if result.clean else 1


def _main_on_actors(ns: argparse.Namespace) -> int:
    from kvtier.bench import actor_soak
    from kvtier.errors import ConfigError

    tp, instances = ns.tp or 1, ns.instances or 1
    if not 1 <= tp <= 8 or not 1 <= instances <= 8:
        raise ConfigError(f"--tp and --instances must be 1..8, got {tp} and {instances}")
    params = actor_soak.ActorSoakParams(
        tp=tp, instances=instances, l3=ns.l3, model=ns.model, seconds=60 * ns.minutes,
        max_requests=ns.max_requests, fault_every_s=ns.fault_every, seed=ns.seed)
    result = actor_soak.run(params)
    print(json.dumps({"benchmark": "soak", "tp": tp, "instances": instances, "l3": ns.l3,
                      "model": ns.model, **result._asdict()}))
    return 0 if result.clean else 1
