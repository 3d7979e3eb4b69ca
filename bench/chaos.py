"""`kvtier bench chaos`: the served graph under real and adversarial clients while faults hit
it; every greedy answer checked against a cold run, the ranks audited for leaks afterwards.

    kvtier bench chaos --minutes 2 --l3 file --json
    kvtier bench chaos --minutes 2 --l3 mooncake --pd --json
    kvtier bench chaos --minutes 2 --model smollm2 --json    (the real model, at TP 3)

The graph is the one `kvtier serve` deploys (actors/serve_graph.py) on a new local Ray
cluster on 127.0.0.1: two mixed instances at TP 2 (`--pd`: one prefill and one decode
instance), in fp32 (`--dtype`: in bf16 a batch's composition moves greedy answers), with an
L3 of `--l3` shared through the namespace actor. The model is the tiny one by default
(random weights over SmolLM2's vocabulary and tokenizer): on two cores SmolLM2 at TP 3 (its
three KV heads do not split over two ranks; `--tp` chooses) serves a few requests a minute,
and the run is about the serving machinery under faults, not the model's speed.

The clients (bench/chaos_clients.py): conversations (multi-turn chat about a few shared
documents, greedy, half streamed), an adversary (random bodies with extreme values,
bench/chaos_bodies.py; streams it hangs up on midway; `n` 16 with `top_logprobs` 20 at the
token limit). The faults (actors/chaos_faults.py), one every `--fault-every` seconds, each
kind in turn: a rank killed (`--pd`: a prefill or a decode rank), the namespace actor killed,
the namespace actor killed with its state lost, and with `--l3 mooncake` the Mooncake master
killed (its supervisor restarts it); a kind the time left no room for, or never armed, comes
again right after the traffic (within FAULT_GRACE_S). When the time is up no request starts; those in flight
end (each bounded by `--request-timeout`); once the instances are idle every rank is audited
(retried for `--settle` seconds while anything is still held); the cluster stops; then each
greedy answer, streamed tokens included, is judged against cold runs in this process
(bench/cold_judge.py: the same answer, a near-tie, or wrong; a spliced stream is wrong).

JSON: `sent`, `answered`, `refused_4xx` (adversarial bodies), `server_errors` (well-formed
requests that got an error), `wrong`, `near_ties`, `instances_lost`, `leaked_pages`,
`leaked_locks`, `faults_injected` (by kind), and more: `adversarial_server_errors` (bodies
answered with a 5xx or not at all), `checked`, `cancelled`, `error_kinds`,
`wrong_samples`, `lost` (instance: when and why), `rank_epochs`, `faults` (each one: when,
where, armed, the errors until the next one and the causes of the first few), `missed` (the
targets missed), `tenant_probes` and `tenant_shared_tokens` (two tenants, by `cache_salt`,
ask the same new document; the cached tokens the second is told, answers that moved
instances apart: `tenant_moved`). Targets: `wrong`, `server_errors`,
`adversarial_server_errors`, `instances_lost`, `leaked_pages`, `leaked_locks` and
`tenant_shared_tokens` all 0; the exit code is 1 when one is missed.
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import enum
import logging
import random
import secrets
import shutil
import sys
import tempfile
import time
from collections import Counter
from typing import Any, NamedTuple

from kvtier.bench import emit, stdout_to_stderr
from kvtier.bench.answer_check import Verdict
from kvtier.bench.chaos_bodies import Limits
from kvtier.bench.chaos_clients import Answer, ClientParams, ErrorRecord, Tally, Traffic
from kvtier.bench.chaos_monitor import Monitor, get_json, idle
from kvtier.bench.chaos_vllm import (RECOVER_WITHIN_S, VllmFaults, engine_audit, open_engines,
                                     record_probes, vllm_chaos_settings, warm_up)
from kvtier.cli.shared_flags import add_dtype_flag, add_l3_flag, add_model_flag, add_tp_flag
from kvtier.dtypes import DType
from kvtier.errors import ConfigError
from kvtier.policies import StorageBackendKind, Transport
from kvtier.frontend.settings import L3_NONE, EngineKind, ModelChoice, ServeSettings

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
MAX_MINUTES = 120.0
READY_TIMEOUT_S = 600.0
MAX_FAULT_GAP_S = 30.0
MIN_FAULT_GAP_S = 5.0
FAULT_GRACE_S = 120.0  # after the traffic, for the fault kinds it left no room for
WRONG_SAMPLES = 8
ERROR_SAMPLES = 3  # errors kept word for word, per fault
L3_KINDS = (StorageBackendKind.FILE, StorageBackendKind.MOONCAKE)
TARGETS = ("wrong", "server_errors", "adversarial_server_errors", "instances_lost",
           "leaked_pages", "leaked_locks", "tenant_shared_tokens")


class Fault(enum.Enum):
    KILL_RANK = "kill_rank"  # a rank of a mixed instance
    KILL_PREFILL_RANK = "kill_prefill_rank"
    KILL_DECODE_RANK = "kill_decode_rank"
    KILL_NAMESPACE = "kill_namespace"  # Ray restarts it; it restores its state
    NAMESPACE_STATE_LOST = "namespace_state_lost"  # killed after its state dir was deleted
    RESTART_MOONCAKE_MASTER = "restart_mooncake_master"  # killed; its supervisor restarts it
    # the vLLM path's (bench/chaos_vllm.py)
    KILL_ENGINE = "kill_engine"  # an EngineCore or worker process killed; Serve replaces it
    STOP_HOLDER = "stop_holder"  # a peer's workers stopped while another reads its L2
    CORRUPT_L3 = "corrupt_l3"  # page objects overwritten with garbage
    L3_FULL = "l3_full"  # the L3 volume full: writes fail with ENOSPC
    LATE_RANK_FETCH = "late_rank_fetch"  # one TP rank's L3 reads delayed


VLLM_FAULTS = (Fault.KILL_ENGINE, Fault.STOP_HOLDER, Fault.CORRUPT_L3, Fault.L3_FULL,
               Fault.LATE_RANK_FETCH)
# Where a fault comes in its round (kinds of one place in a seeded order): the vLLM path's
# storage faults send a document from one engine to the other, so they go while both engines
# run and the directory knows the namespace; the engine kill comes last (its instance serves
# again only a minute or more later).
ROUND_PLACE = {Fault.STOP_HOLDER: 0, Fault.CORRUPT_L3: 0, Fault.L3_FULL: 0,
               Fault.LATE_RANK_FETCH: 0, Fault.KILL_ENGINE: 2}


def fault_kinds(l3: StorageBackendKind | None, pd: bool, engine: EngineKind = EngineKind.KVTIER,
                peers: Transport | None = None) -> list[Fault]:
    """The faults a run of this graph injects, each in turn."""
    if engine is EngineKind.VLLM:
        kinds = [Fault.KILL_ENGINE]
        if peers is not None:
            kinds.append(Fault.STOP_HOLDER)
        if l3 is not None or peers is not None:  # the namespace actor runs
            kinds += [Fault.KILL_NAMESPACE, Fault.NAMESPACE_STATE_LOST]
        if l3 is StorageBackendKind.FILE:
            kinds += [Fault.CORRUPT_L3, Fault.L3_FULL, Fault.LATE_RANK_FETCH]
        return kinds
    kinds = [Fault.KILL_PREFILL_RANK, Fault.KILL_DECODE_RANK] if pd else [Fault.KILL_RANK]
    kinds += [Fault.KILL_NAMESPACE, Fault.NAMESPACE_STATE_LOST]
    if l3 is StorageBackendKind.MOONCAKE:
        kinds.append(Fault.RESTART_MOONCAKE_MASTER)
    return kinds


class ChaosParams(NamedTuple):
    minutes: float = 2.0
    l3: StorageBackendKind | None = StorageBackendKind.FILE  # None: no L3 (vLLM only)
    pd: bool = False
    model: str = "tiny"  # an alias, a model directory or a GGUF file, as kvtier serve takes
    dtype: DType = DType.FP32
    tp: int | None = None  # None: 2, or the smallest size that splits the model (vLLM: 1)
    fault_every_s: float | None = None  # None: spread so each kind comes once, 5-30 s apart
    clients: ClientParams = ClientParams()
    port: int = 8150
    settle_s: float = 60.0
    engine: EngineKind = EngineKind.KVTIER
    peers: Transport | None = None  # vLLM: the instances read each other's L2 over it
    recover_within_s: float = RECOVER_WITHIN_S  # vLLM: an instance back later is lost

    @property
    def vllm(self) -> bool:
        return self.engine is EngineKind.VLLM

    @property
    def seconds(self) -> float:
        return 60.0 * self.minutes


class FaultRecord(NamedTuple):
    kind: Fault
    at_s: float
    armed: bool
    where: str


# ---- the deployment --------------------------------------------------------------------------
def tp_size(model: str, asked: int | None) -> int:
    """`asked`, or 2 when the model splits over two ranks, else the smallest size that does;
    a size that does not split the model is refused here, before any rank starts."""
    from kvtier.engine.parallel import TensorParallel
    from kvtier.frontend.served_model import weight_source

    config = weight_source(ServeSettings(model=model)).config()

    def splits(size: int) -> bool:
        try:
            TensorParallel(0, size).check(config)
        except ConfigError:
            return False
        return True

    if asked is not None:
        if not splits(asked):
            TensorParallel(0, asked).check(config)  # raises, saying which sizes split
        return asked
    size = next((n for n in range(2, 9) if splits(n)), 1)
    if size != 2:
        log.warning("%s does not split over 2 ranks; running TP %d", config.name, size)
    return size


def chaos_settings(p: ChaosParams, tmp: str) -> ServeSettings:
    """The graph: two mixed instances (or one prefill and one decode), small L1 so that L2
    and L3 serve, everything on loopback, the L3 and the namespace state under `tmp`; over
    vLLM, bench/chaos_vllm.py's."""
    if p.vllm:
        return vllm_chaos_settings(p, tmp, secrets.token_urlsafe(24))
    tiny = ServeSettings(model=p.model).model is ModelChoice.TINY
    page = 16 if tiny else 64
    shape = ({"prefill_instances": 1, "decode_instances": 1} if p.pd else {"instances": 2})
    return ServeSettings(model=p.model, **shape, tp_size=tp_size(p.model, p.tp),
                         page_size=page, chunk_tokens=4 * page,
                         device_pages=128 if tiny else 40, max_new_tokens=32, dtype=p.dtype,
                         storage_backend=p.l3,
                         l3_root="" if p.l3 is StorageBackendKind.MOONCAKE else f"{tmp}/l3",
                         l3_state_dir=f"{tmp}/l3-state", l3_actor="kvtier-chaos-l3",
                         admin_key=secrets.token_urlsafe(24))


def limits_of(s: ServeSettings, vocab_size: int) -> Limits:
    return Limits(s.served_model_name, vocab_size, s.max_prompt_tokens, s.max_new_tokens,
                  s.max_body_bytes)


def wait_until(what, timeout_s: float, every_s: float = 0.5) -> bool:
    """Poll `what()` until it is true or `timeout_s` passed; whether it became true."""
    deadline = time.monotonic() + timeout_s
    while not what():
        if time.monotonic() >= deadline:
            return False
        time.sleep(every_s)
    return True


# ---- faults ----------------------------------------------------------------------------------
class Injector:
    """One fault every `every_s` seconds after the traffic starts, the kinds in turn (each
    round in a seeded order, placed by ROUND_PLACE); each applied in a thread, so the clients
    keep going; none after the deadline but the kinds not injected yet (each comes once). `vllm`: the vLLM path's faults
    (bench/chaos_vllm.VllmFaults), whose probe requests go into `tally`."""

    def __init__(self, chaos: Any, settings: ServeSettings, kinds: list[Fault], every_s: float,
                 seed: int, vllm: Any = None, tally: Tally | None = None,
                 token_bytes: Any = None) -> None:
        from kvtier.actors.chaos_faults import rank_targets

        self.chaos, self.kinds, self.every_s = chaos, kinds, every_s
        self.targets = rank_targets(settings)
        self.tp = settings.tp_size
        self.rng = random.Random(f"{seed}:faults")
        self.records: list[FaultRecord] = []
        self.vllm, self.tally, self.token_bytes = vllm, tally, token_bytes
        self.probes = 0

    def plan(self, count: int) -> list[Fault]:
        out: list[Fault] = []
        while len(out) < count:
            round_ = list(self.kinds)
            self.rng.shuffle(round_)
            out += sorted(round_, key=lambda kind: ROUND_PLACE.get(kind, 1))  # stable
        return out[:count]

    async def run(self, start: float, deadline: float) -> None:
        count = max(0, int((deadline - start) // self.every_s))
        if (deadline - start) - count * self.every_s < self.every_s / 3:
            count = max(0, count - 1)  # no fault in the last moments: it would go unseen
        for i, kind in enumerate(self.plan(count), start=1):
            wait_s = start + i * self.every_s - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            if time.monotonic() >= deadline:  # faults that took long left no time for it
                break
            await self._inject(kind, start)
        # every kind comes once: those the time left no room for (faults whose probes took
        # long on a loaded machine), or whose every try found what it needs missing (an
        # instance too slow to name its engine), again after the traffic, within
        # FAULT_GRACE_S
        while time.monotonic() < deadline + FAULT_GRACE_S:
            missing = [k for k in self.kinds if k not in {r.kind for r in self.records
                                                          if r.armed}]
            if not missing:
                break
            for kind in missing:
                if time.monotonic() >= deadline + FAULT_GRACE_S:
                    break
                await self._inject(kind, start)
            await asyncio.sleep(min(self.every_s, 5.0))

    async def _inject(self, kind: Fault, start: float) -> None:
        at_s = time.monotonic() - start
        armed, where = await asyncio.to_thread(self._apply, kind)
        self.records.append(FaultRecord(kind, at_s, armed, where))
        log.warning("chaos: %s %s at %.1f s (%s)", kind.value, where, at_s,
                    "armed" if armed else "not armed")
        self._count_probes()

    def _count_probes(self) -> None:
        """The vLLM faults' probe requests, counted with the clients' (in their thread)."""
        if self.vllm is not None and self.tally is not None:
            probes = self.vllm.take_probes()
            self.probes += len(probes)
            record_probes(self.tally, probes, self.token_bytes)

    def _apply(self, kind: Fault) -> tuple[bool, str]:
        from kvtier.actors.chaos_faults import Role

        roles = {Fault.KILL_RANK: Role.MIXED, Fault.KILL_PREFILL_RANK: Role.PREFILL,
                 Fault.KILL_DECODE_RANK: Role.DECODE}
        try:
            if kind in VLLM_FAULTS:
                v = self.vllm
                return {Fault.KILL_ENGINE: v.kill_engine, Fault.STOP_HOLDER: v.stop_holder,
                        Fault.CORRUPT_L3: v.corrupt_l3, Fault.L3_FULL: v.l3_full,
                        Fault.LATE_RANK_FETCH: v.late_rank_fetch}[kind]()
            if kind in roles:
                target = self.rng.choice([t for t in self.targets if t.role is roles[kind]])
                rank = self.rng.randrange(self.tp)
                return self.chaos.kill_rank(target, rank), f"{target.name} rank {rank}"
            if kind is Fault.KILL_NAMESPACE:
                return self.chaos.kill_namespace(lose_state=False), "namespace actor"
            if kind is Fault.NAMESPACE_STATE_LOST:
                return self.chaos.kill_namespace(lose_state=True), "namespace actor and state"
            return self.chaos.restart_mooncake_master(), "mooncake master"
        except Exception as exc:  # noqa: BLE001 - a fault that could not be injected is a record
            log.warning("chaos: %s could not be injected: %s", kind.value, exc)
            return False, f"failed: {type(exc).__name__}: {exc}"[:300]


def fault_gap_s(p: ChaosParams, kinds: int) -> float:
    if p.fault_every_s is not None:
        return p.fault_every_s
    return min(MAX_FAULT_GAP_S, max(MIN_FAULT_GAP_S, p.seconds / (kinds + 1)))


# ---- the run ---------------------------------------------------------------------------------
class Served(NamedTuple):
    """What the running graph gave: the traffic, the faults, the audit, the router's view."""

    tally: Tally
    faults: list[FaultRecord]
    audit: Any  # actors.chaos_faults.RankAudit, or None when the audit itself failed
    audit_error: str
    lost: dict[str, dict]  # instance -> when (s) and why
    epochs: dict[str, int]
    stalls: dict[str, int]
    idle: bool  # the instances went idle after the traffic
    duration_s: float
    recoveries: dict[str, list] = {}  # vLLM: instance -> its outages that ended
    probes: int = 0  # vLLM: the faults' own requests
    l3_volume: str | None = None  # vLLM's file L3: "tmpfs" (can be filled) or "directory"


def serve_and_load(p: ChaosParams, settings: ServeSettings, limits: Limits,
                   volume: Any = None) -> Served:
    """Start the graph, run the traffic and the faults, audit the ranks (vLLM: the engines),
    stop it all. `volume`: a vLLM graph's file L3 (bench/chaos_l3.L3Volume)."""
    from kvtier.actors import serve_graph
    from kvtier.actors.chaos_faults import ChaosFaults

    base = f"http://{LOOPBACK}:{p.port}"
    kinds = fault_kinds(p.l3, p.pd, p.engine, p.peers)
    chaos = monitor = None
    try:
        serve_graph.start(settings, host=LOOPBACK, port=p.port)
        chaos = ChaosFaults(settings)
        engines = open_engines(settings) if p.vllm else None
        if not wait_until(lambda: get_json(f"{base}/health")[0] == 200, READY_TIMEOUT_S):
            raise ConfigError(f"the graph did not become healthy at {base} within "
                              f"{READY_TIMEOUT_S:.0f} s; see the Ray logs")
        if engines is not None:
            warm_up(engines, READY_TIMEOUT_S)
        monitor = Monitor(base, settings.admin_key, chaos.deployment_states,
                          p.recover_within_s if p.vllm else None)
        monitor.start()
        start = monitor.start_s
        deadline = start + p.seconds
        traffic = Traffic(base, p.clients, limits, start, deadline)
        vllm = None
        if engines is not None:
            vllm = VllmFaults(settings, engines, volume, start, p.clients.seed)
        injector = Injector(chaos, settings, kinds, fault_gap_s(p, len(kinds)), p.clients.seed,
                            vllm, traffic.tally, _token_bytes(settings))
        tally = asyncio.run(traffic.run([injector.run(start, deadline)]))
        duration_s = time.monotonic() - start
        if vllm is not None:  # a killed engine's new replica may still be starting
            wait_until(lambda: monitor.all_up and vllm.engines_back(), p.recover_within_s,
                       every_s=1.0)
        went_idle = wait_until(lambda: idle(base, settings.admin_key), p.settle_s)
        audit, audit_error = _audit(
            (lambda: engine_audit(engines)) if engines is not None else chaos.audit,
            p.settle_s)
        monitor.stop()  # its last look sees the instances after the audit
        return Served(tally, injector.records, audit, audit_error, monitor.lost,
                      monitor.epochs, monitor.stalls, went_idle, duration_s,
                      monitor.recoveries, injector.probes,
                      None if volume is None else "tmpfs" if volume.mounted else "directory")
    finally:
        try:
            if monitor is not None and monitor.is_alive():
                monitor.stop()
            if chaos is not None:
                chaos.close()
        finally:
            serve_graph.stop()


def _token_bytes(settings: ServeSettings) -> Any:
    from kvtier.frontend.served_model import tokenizer

    return tokenizer(settings).token_bytes


def _audit(audit_now: Any, settle_s: float) -> tuple[Any, str]:
    """The audit (every rank's, or every vLLM engine's), again every second while something
    is held, up to `settle_s` (a hand-off's reserved pages are held until their deadline;
    copies settle inside)."""
    deadline = time.monotonic() + settle_s
    audit, error = None, ""
    while True:
        try:
            audit, error = audit_now(), ""
        except Exception as exc:  # noqa: BLE001 - an audit that fails is reported as such
            error = f"{type(exc).__name__}: {exc}"[:500]
        if (audit is not None and audit.clean and not error) or time.monotonic() >= deadline:
            return audit, error
        time.sleep(1.0)


# ---- judging ---------------------------------------------------------------------------------
class Judgement(NamedTuple):
    checked: int
    same: int
    near_ties: int
    wrong: int
    samples: list


def judge_answers(answers: list[Answer], settings: ServeSettings) -> Judgement:
    """Every answer of every greedy request against cold runs (bench/cold_judge.py)."""
    from kvtier.bench.cold_judge import ColdJudge
    from kvtier.dtypes import resolve_here

    counts = {v: 0 for v in Verdict}
    samples: list[dict] = []
    if not answers:
        return Judgement(0, 0, 0, 0, [])
    with ColdJudge(settings, resolve_here(settings.dtype)) as judge:
        for ans in answers:
            prompt = ans.prompt or judge.chat_prompt(ans.messages)
            stops = () if ans.ignore_eos else judge.stop_token_ids
            for index, raw in enumerate(ans.choices):
                got = judge.token_ids(raw)
                if got is None or not got:
                    verdict, at, got = Verdict.WRONG, 0, got or ()
                else:
                    verdict, at = judge.check(prompt, got, ans.max_tokens, stops)
                counts[verdict] += 1
                if verdict is Verdict.WRONG and len(samples) < WRONG_SAMPLES:
                    cold = judge.cold(prompt, ans.max_tokens, stops).tokens
                    samples.append({"kind": ans.kind.value, "at_s": round(ans.at_s, 1),
                                    "choice": index, "token": at, "got": list(got),
                                    "cold": list(cold), "prompt_tokens": len(prompt)})
    return Judgement(sum(counts.values()), counts[Verdict.SAME], counts[Verdict.NEAR_TIE],
                     counts[Verdict.WRONG], samples)


def vocab_size(settings: ServeSettings) -> int:
    from kvtier.frontend.served_model import tokenizer

    return tokenizer(settings).vocab_size


def run(p: ChaosParams) -> dict:
    """One chaos run; its result (the JSON object, `missed` naming the targets missed)."""
    tmp = tempfile.mkdtemp(prefix="kvtier-chaos-")
    volume = None
    try:
        if p.vllm and p.l3 is StorageBackendKind.FILE:  # a volume of its own, to fill
            from kvtier.bench.chaos_l3 import L3Volume

            volume = L3Volume(f"{tmp}/l3")
        settings = chaos_settings(p, tmp)
        served = serve_and_load(p, settings, limits_of(settings, vocab_size(settings)), volume)
        judged = judge_answers(served.tally.answers, settings)  # a vLLM tiny model is in tmp
    finally:
        try:
            if volume is not None:
                volume.close()
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return result_json(p, settings, served, judged)


def errors_between(faults: list[FaultRecord], errors: list[ErrorRecord]) -> list[list]:
    """The errors that came before the first fault, then after each fault until the next."""
    starts = [f.at_s for f in faults]
    windows: list[list] = [[] for _ in range(len(faults) + 1)]
    for e in errors:
        windows[bisect.bisect_right(starts, e.failed_s)].append(e)
    return windows


def _samples(errors: list[ErrorRecord]) -> list[dict]:
    return [{"sent_s": round(e.sent_s, 1), "failed_s": round(e.failed_s, 1), "kind": e.kind,
             "well_formed": e.well_formed, "cause": e.cause} for e in errors[:ERROR_SAMPLES]]


def result_json(p: ChaosParams, settings: ServeSettings, served: Served,
                judged: Judgement) -> dict:
    t, audit = served.tally, served.audit
    windows = errors_between(served.faults, t.errors)
    members = {"pd": settings.prefill_instances + settings.decode_instances}
    injected: dict[str, int] = {}
    not_armed: dict[str, int] = {}
    for f in served.faults:
        bucket = injected if f.armed else not_armed
        bucket[f.kind.value] = bucket.get(f.kind.value, 0) + 1
    out = {
        "sent": t.sent, "answered": t.answered, "refused_4xx": t.refused_4xx,
        "server_errors": t.server_errors, "wrong": judged.wrong, "near_ties": judged.near_ties,
        "instances_lost": sum(members.get(name, 1) for name in served.lost),
        "leaked_pages": audit.leaked_pages if audit is not None else None,
        "leaked_locks": audit.leaked_locks if audit is not None else None,
        "faults_injected": injected,
        "tenant_shared_tokens": t.tenant_shared_tokens, "tenant_probes": t.tenant_probes,
        "tenant_moved": t.tenant_moved,
        "adversarial_server_errors": t.adversarial_server_errors,
        "adversarial_answered": t.adversarial_answered, "cancelled": t.cancelled,
        "unaccounted": t.sent - t.answered - t.refused_4xx - t.server_errors
                       - t.adversarial_server_errors - t.cancelled,
        "checked": judged.checked, "same": judged.same,
        "answers_by_kind": dict(Counter(a.kind.value for a in t.answers)),
        "faults_not_armed": not_armed,
        "faults": [{"kind": f.kind.value, "at_s": round(f.at_s, 1), "armed": f.armed,
                    "where": f.where, "errors_until_next": len(errors),
                    "error_samples": _samples(errors)}
                   for f, errors in zip(served.faults, windows[1:])],
        "errors_before_faults": len(windows[0]),
        "error_samples_before_faults": _samples(windows[0]),
        "lost": served.lost, "rank_epochs": served.epochs, "stalls": served.stalls,
        "recoveries": served.recoveries, "probes": served.probes,
        "l3_volume": served.l3_volume,
        "went_idle": served.idle,
        "open_tickets": audit.open_tickets if audit is not None else None,
        "engine_audit": getattr(audit, "by_instance", None) if p.vllm else None,
        "audit_error": served.audit_error or None,
        "error_kinds": dict(Counter(e.kind for e in t.errors)),
        "adversarial_statuses": {str(k): v for k, v in sorted(t.statuses.items())},
        "wrong_samples": judged.samples,
        "duration_s": round(served.duration_s, 1),
        "settings": {"engine": settings.engine.value, "model": settings.model.value,
                     "tp": settings.tp_size,
                     "instances": settings.instances, "pd": settings.pd, "l3": settings.l3_name,
                     "peer_transport": settings.peer_transport and settings.peer_transport.value,
                     "dtype": settings.dtype.value, "page_size": settings.page_size,
                     "device_pages": settings.device_pages, "minutes": p.minutes,
                     "conversations": p.clients.conversations, "seed": p.clients.seed},
    }
    missed = [name for name in TARGETS if out[name] is None or out[name] != 0]
    return {**out, "missed": missed}


# ---- the command -------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=2.0,
                   help=f"how long the traffic runs (default 2, at most {MAX_MINUTES:.0f})")
    p.add_argument("--engine", choices=[e.value for e in EngineKind],
                   default=EngineKind.KVTIER.value,
                   help="what each instance runs: kvtier (default: kvtier's engine, its ranks "
                        "killed) or vllm (a vLLM engine with KvtierConnector: its processes "
                        "killed and stopped, its L3 corrupted, filled and read late)")
    add_l3_flag(p, None, kinds=L3_KINDS, allow_none=True,
                note="; mooncake (kvtier engine): its master is restarted as a fault too; "
                     "none (vllm): peers only. With --engine vllm and --peer-transport the "
                     "default is none, so that every page one instance takes from another "
                     "is a peer read")
    p.add_argument("--peer-transport", default=None,
                   choices=[t.value for t in Transport.across_processes()],
                   help="--engine vllm: the instances read each other's L2 over this (default "
                        "off); their holders are stopped mid-read as a fault too")
    p.add_argument("--pd", action="store_true",
                   help="one prefill and one decode instance in place of two mixed ones "
                        "(kvtier engine)")
    add_model_flag(p, ModelChoice.TINY.value,
                   note=": fast enough that the serving, not the model, is what runs; smollm2 "
                        "runs at TP 3 (vllm: TP 1)")
    add_dtype_flag(p, DType.FP32.value, note=": in bf16 a batch's composition moves greedy "
                                             "answers")
    add_tp_flag(p, None, "default 2, or the smallest size that splits the model: 3 for "
                         "SmolLM2; --engine vllm: 1")
    p.add_argument("--recover-within", type=float, default=RECOVER_WITHIN_S, metavar="SECONDS",
                   help="--engine vllm: an instance whose engine was killed must serve again "
                        f"within this (Serve starts a new replica; default "
                        f"{RECOVER_WITHIN_S:.0f}), else it is lost")
    p.add_argument("--fault-every", type=float, default=None, metavar="SECONDS",
                   help="seconds between faults (default: each kind once over the run, "
                        f"{MIN_FAULT_GAP_S:.0f}-{MAX_FAULT_GAP_S:.0f} s apart)")
    p.add_argument("--clients", type=int, default=3, help="conversations at once (default 3)")
    p.add_argument("--max-requests", type=int, default=100_000)
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="seconds for one request (default 120)")
    p.add_argument("--settle", type=float, default=60.0,
                   help="seconds the instances get to go idle, and the audit to come clean, "
                        "after the traffic (default 60)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=8150, help="HTTP port on 127.0.0.1")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def params_of(ns: argparse.Namespace) -> ChaosParams:
    if not 0 < ns.minutes <= MAX_MINUTES:
        raise ConfigError(f"--minutes must be in (0, {MAX_MINUTES:.0f}], got {ns.minutes}")
    if ns.fault_every is not None and ns.fault_every < 1:
        raise ConfigError(f"--fault-every must be at least 1 second, got {ns.fault_every}")
    for name in ("clients", "max_requests"):
        if getattr(ns, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1")
    if not 1 <= ns.request_timeout <= 3600 or not 0 <= ns.settle <= 3600:
        raise ConfigError("--request-timeout must be in [1, 3600] and --settle in [0, 3600]")
    if not 10 <= ns.recover_within <= 3600:
        raise ConfigError("--recover-within must be in [10, 3600] seconds")
    engine = EngineKind.parse(ns.engine, "--engine")
    peers = (None if ns.peer_transport is None
             else Transport.parse_across(ns.peer_transport, "--peer-transport"))
    l3 = _l3_of(ns.l3, engine, peers)
    if engine is EngineKind.VLLM and ns.pd:
        raise ConfigError("--pd: prefill/decode disaggregation runs on kvtier's engine only; "
                          "drop --pd or --engine vllm")
    if engine is EngineKind.KVTIER and peers is not None:
        raise ConfigError("--peer-transport: the chaos run of kvtier's engine injects no peer "
                          "faults; use it with --engine vllm")
    clients = ClientParams(conversations=ns.clients, max_requests=ns.max_requests,
                           request_timeout_s=ns.request_timeout, seed=ns.seed)
    return ChaosParams(minutes=ns.minutes, l3=l3, pd=ns.pd,
                       model=ns.model, dtype=DType.parse(ns.dtype, "--dtype"),
                       tp=ns.tp, fault_every_s=ns.fault_every, clients=clients, port=ns.port,
                       settle_s=ns.settle, engine=engine, peers=peers,
                       recover_within_s=ns.recover_within)


def _l3_of(given: str | None, engine: EngineKind,
           peers: Transport | None) -> StorageBackendKind | None:
    """`--l3`: file unless given; with --engine vllm file or none (none by default with
    --peer-transport)."""
    if given is None:
        return None if engine is EngineKind.VLLM and peers is not None \
            else StorageBackendKind.FILE
    if given == L3_NONE:
        if engine is EngineKind.KVTIER:
            raise ConfigError("--l3 none: the chaos run of kvtier's engine needs an L3 (file "
                              "or mooncake)")
        return None
    kind = StorageBackendKind.parse(given, "--l3")
    if engine is EngineKind.VLLM and kind is not StorageBackendKind.FILE:
        raise ConfigError(f"--l3 {kind.value}: the chaos run over vLLM runs a file L3 (its "
                          f"faults fill and corrupt it) or none")
    return kind


def main(ns: argparse.Namespace) -> int:
    params = params_of(ns)
    with stdout_to_stderr(ns.json):
        result = run(params)
    emit({"benchmark": "chaos", **result}, ns.json)
    if result["missed"]:
        print(f"kvtier bench chaos: targets missed: {', '.join(result['missed'])}",
              file=sys.stderr)
        return 1
    return 0
