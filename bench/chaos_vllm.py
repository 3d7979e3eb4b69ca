"""`kvtier bench chaos --engine vllm`: the same serve graph with each instance a vLLM engine and
KvtierConnector as its L2 and L3 (docs/benchmarks.md, "Serving under faults"), its settings,
its model, and the faults of the vLLM path.

The tiny model (`--model tiny`) is kvtier's own random-weight model, which vLLM cannot load;
under vLLM it is a random-weight Llama written as a Hugging Face directory beside the run
(SmolLM2's tokenizer and chat template, 2 layers, 4 query / 2 KV heads of 32 dims: vLLM's CPU
attention has no kernel for heads under 32, and 2 KV heads split over TP 1 and 2).

The faults (`VllmFaults`: each returns whether it was armed, and where), each where its graph
has what it needs:
- `kill_engine`: SIGKILL to one instance's EngineCore or one of its workers. The replica's
  engine is dead, its requests move to the other instance (they go on after what their
  clients have), its health check fails and Serve starts a new replica. Armed only while
  every instance runs, so that the others can take over.
- `stop_holder` (peers on): an instance W computes a new document (with a file L3, while the
  L3 volume is full: the document stays out of L3, so only W's L2 has it), the directory
  lists it in W's L2, W's workers are stopped (SIGSTOP) for STOP_S while the other instance
  reads the document (a probe sent to it directly): its peer read meets a holder that does
  not answer, and it must fall back; then SIGCONT.
- `corrupt_l3` (file L3): W computes a new document, the directory publishes it, the page
  objects written since are overwritten with garbage; the other instance reads it.
- `l3_full` (file L3): the L3 volume filled for FULL_S (writes fail with ENOSPC) while W
  computes a new document; then emptied.
- `late_rank_fetch` (file L3): W computes a new document, the directory publishes it, one TP
  rank's L3 reads are delayed (1 s: the request waits and loads; 4 s: past its prefetch
  patience, it computes while the late read still lands) while the other instance reads it.
The probes (the documents and the reads) are requests like the clients': counted, and their
answers judged. The namespace actor's faults are the kvtier graph's (actors/chaos_faults.py).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.bench.chaos_clients import Answer, AnswerKind, Tally
from kvtier.errors import ConfigError
from kvtier.frontend.settings import ServeSettings

log = logging.getLogger(__name__)

TINY_DIR = "tiny-vllm"
TINY_SEED = 0
PROBE_PAGES = 6  # pages of a probe's document
PROBE_TOKENS = 8  # answer tokens of a probe
PROBE_TIMEOUT_S = 120.0
LISTED_TIMEOUT_S = 8.0  # for the directory to list a probe's pages (stored, or held in L2)
UP_TIMEOUT_S = 30.0  # for a replica to name its engine's processes (on a loaded machine a
# replica busy with its clients took over 5 s: its instance looked down, its faults unarmed)
STOP_S = 6.0
FULL_S = 8.0
LATE_DELAYS_S = (1.0, 4.0)  # under, then over, a short prompt's prefetch patience (~2 s)
RECOVER_WITHIN_S = 300.0  # a new replica's engine starts in 30-90 s on two cores
# a vLLM step on two shared cores (two engines, the clients, Ray) can take seconds: with the
# 2 s default the first requests' steps held both instances stalled at once (503s)
STALL_TIMEOUT_S = 10.0


def tiny_hf_dir(parent: str) -> str:
    """The tiny model as a Hugging Face directory under `parent` (written once)."""
    from safetensors.torch import save_file

    from kvtier.engine.hf_export import smollm2_hf_dir
    from kvtier.engine.model_config import tiny_config
    from kvtier.engine.weights import random_state_dict

    target = Path(parent) / TINY_DIR
    if (target / "model.safetensors").is_file():
        return str(target)
    smol = smollm2_hf_dir()
    hf = json.loads((smol / "config.json").read_text())
    config = dataclasses.replace(tiny_config(vocab_size=hf["vocab_size"]), hidden_size=128,
                                 num_heads=4, num_kv_heads=2, head_dim=32,
                                 intermediate_size=256, name=TINY_DIR)
    hf.update(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
              num_attention_heads=config.num_heads, num_hidden_layers=config.num_layers,
              num_key_value_heads=config.num_kv_heads, head_dim=config.head_dim,
              rms_norm_eps=config.rms_norm_eps, rope_theta=config.rope_theta,
              max_position_embeddings=config.max_position, tie_word_embeddings=True,
              torch_dtype="float32")
    hf.pop("rope_scaling", None)
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(smol / name, target / name)
    (target / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    weights = {k: v.contiguous() for k, v in random_state_dict(config, TINY_SEED).items()}
    save_file(weights, str(target / "model.safetensors"))
    return str(target)


class ProbeRecord(NamedTuple):
    """A probe request and its answer, for the tally (taken in the clients' thread)."""

    at_s: float
    done_s: float
    instance: str
    prompt: tuple[int, ...]
    probe: Any  # actors.chaos_engines.Probe


class VllmFaults:
    """The faults of the vLLM path into the graph of `settings` (module docstring), applied
    one at a time from the injector's thread; `take_probes` hands their requests over."""


    def __init__(self, settings: ServeSettings, engines: Any, volume: Any, start: float,
                 seed: int) -> None:
        """`engines`: actors.chaos_engines.EngineChaos; `volume`: the L3Volume (None: no file
        L3; with one, the fault file of `settings`' L3 options delays reads); `start`: when the
        traffic started."""
        from kvtier.actors.serve_vllm import kv_heads
        from kvtier.bench.chaos_l3 import LateReads

        self.s, self.engines, self.volume = settings, engines, volume
        self.late = None if volume is None else LateReads(settings.l3_options["fault_file"])
        self.start = start
        self.rng = random.Random(f"{seed}:vllm-faults")
        config = model_config(settings)
        self.kv_heads, self.vocab = kv_heads(config), int(config["vocab_size"])
        self._probes: list[ProbeRecord] = []
        self._lock = threading.Lock()
        self._killed: set[int] = set()  # the processes of the engines kill_engine killed

    def take_probes(self) -> list[ProbeRecord]:
        with self._lock:
            out, self._probes = self._probes, []
        return out

    # ---- the faults ---------------------------------------------------------------------------
    def kill_engine(self) -> tuple[bool, str]:
        up = self._up()
        if len(up) < len(self.engines.targets):
            return False, "not every instance runs its engine: no other could take over"
        target, procs = self.rng.choice(up)
        pid = self.rng.choice((*procs.cores, *procs.workers))
        role = "EngineCore" if pid in procs.cores else "worker"
        armed = _signal([pid], signal.SIGKILL)
        if armed:  # the engine goes down whole: back once none of these processes is left
            self._killed.update((*procs.cores, *procs.workers))
        return armed, f"{target.name} {role} pid {pid}"

    def engines_back(self) -> bool:
        """Every instance runs an engine, none of it a process of an engine a fault killed
        (a new engine). The audit waits for this: an engine killed just before the traffic
        ended may not have been seen down by the monitor yet, and its instance cannot be
        audited until it is replaced."""
        up = self._up()
        return len(up) == len(self.engines.targets) and not any(
            self._killed & {*procs.cores, *procs.workers} for _, procs in up)

    def stop_holder(self) -> tuple[bool, str]:
        pair = self._pair()
        if pair is None:
            return False, "fewer than two instances run their engines"
        (holder, procs), (reader, _) = pair
        doc = self._document()
        if self.volume is not None and self.volume.mounted:
            try:  # kept out of L3 (its writes fail), so the reader's only source is the peer
                self.volume.fill()
                self._ask(holder, doc)
            finally:
                self.volume.drain()
        else:
            self._ask(holder, doc)
        lent = self._wait(lambda: self.engines.lent(doc, holder.name))
        stopped = _signal(procs.workers, signal.SIGSTOP)
        until = time.monotonic() + STOP_S
        read: list = []
        try:
            thread = threading.Thread(target=lambda: read.append(self._ask(reader, doc + [7])),
                                      daemon=True)
            thread.start()
            time.sleep(max(0.0, until - time.monotonic()))
        finally:
            _signal(procs.workers, signal.SIGCONT)
        thread.join(PROBE_TIMEOUT_S)
        # armed: the reader was sent to a stopped holder (the directory listed its pages)
        return stopped and lent > 0, (
            f"{holder.name} workers {list(procs.workers)} stopped {STOP_S:.0f} s while "
            f"{reader.name} read a document it held ({lent} pages listed); {_reused(read)}")

    def corrupt_l3(self) -> tuple[bool, str]:
        since = time.time() - 1.0
        stored = self._stored_document()
        if stored is None:
            return False, "fewer than two instances run their engines"
        writer, reader, doc, published = stored
        corrupted = self.volume.corrupt(since)
        read = self._ask(reader, doc + [7])
        # armed: the reader was sent to the document's objects, and they were overwritten
        return corrupted > 0 and published > 0, (
            f"{corrupted} page objects written since {writer.name} computed a document "
            f"({published} pages published) overwritten; {reader.name} read it: "
            f"{_reused([read])}")

    def l3_full(self) -> tuple[bool, str]:
        if not self.volume.mounted:
            return False, self.volume.why_not
        up = self._up()
        if not up:
            return False, "no instance runs its engine"
        target, _ = self.rng.choice(up)
        until = time.monotonic() + FULL_S
        try:
            taken = self.volume.fill()
            full = self.volume.free_bytes() == 0
            doc = self._document()
            self._ask(target, doc)
            time.sleep(max(0.0, until - time.monotonic()))
            published = self.engines.published(doc)
        finally:
            self.volume.drain()
        return full, (f"L3 volume full for {FULL_S:.0f} s ({taken >> 20} MiB taken); "
                      f"{target.name} computed a document meanwhile, {published} of its "
                      f"{PROBE_PAGES} pages published")

    def late_rank_fetch(self) -> tuple[bool, str]:
        stored = self._stored_document()
        if stored is None:
            return False, "fewer than two instances run their engines"
        writer, reader, doc, published = stored
        rank = self.rng.randrange(self.s.tp_size)
        delay_s = self.rng.choice(LATE_DELAYS_S)
        before = self.late.hits()
        self.late.delay(rank * self.kv_heads // self.s.tp_size, delay_s)
        try:
            read = self._ask(reader, doc + [7])
        finally:
            self.late.clear()
        hits = self.late.hits() - before
        return hits > 0, (f"{reader.name} rank {rank}'s L3 reads {delay_s:.0f} s late ({hits} "
                          f"reads) while it read a document {writer.name} computed "
                          f"({published} pages published): {_reused([read])}")

    # ---- helpers ------------------------------------------------------------------------------
    def _up(self) -> list[tuple[Any, Any]]:
        """The instances whose engine runs now, with its processes."""
        out = []
        for target in self.engines.targets:
            try:
                procs = self.engines.processes(target, UP_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - a replica being replaced is not up
                log.warning("chaos: %s names no engine processes now: %s", target.name, exc)
                continue
            if procs.cores and procs.workers:
                out.append((target, procs))
            else:
                log.warning("chaos: %s runs no whole engine now: %s", target.name, procs)
        return out

    def _pair(self) -> tuple[tuple[Any, Any], tuple[Any, Any]] | None:
        up = self._up()
        if len(up) < 2:
            return None
        first, second = self.rng.sample(up, 2)
        return first, second

    def _stored_document(self) -> tuple[Any, Any, list[int], int] | None:
        """Two running instances, a new document the first computed, and how many of its
        pages the directory published in L3 (None: not two instances run)."""
        pair = self._pair()
        if pair is None:
            return None
        (writer, _), (reader, _) = pair
        doc = self._document()
        self._ask(writer, doc)
        return writer, reader, doc, self._wait(lambda: self.engines.published(doc))

    def _document(self) -> list[int]:
        """A prompt no request has sent: PROBE_PAGES pages and a few tokens more."""
        count = PROBE_PAGES * self.s.page_size + 3
        low = min(1000, self.vocab // 4)  # past the special tokens
        return [self.rng.randrange(low, self.vocab - low) for _ in range(count)]

    def _ask(self, target: Any, prompt: list[int]) -> Any:
        at_s = time.monotonic() - self.start
        probe = self.engines.ask(target, prompt, PROBE_TOKENS, PROBE_TIMEOUT_S)
        with self._lock:
            self._probes.append(ProbeRecord(at_s, time.monotonic() - self.start, target.name,
                                            tuple(prompt), probe))
        if probe.error:
            log.warning("chaos: a probe to %s failed: %s", target.name, probe.error)
        return probe

    @staticmethod
    def _wait(pages) -> int:
        """Poll `pages()` until PROBE_PAGES or LISTED_TIMEOUT_S; the last count."""
        deadline = time.monotonic() + LISTED_TIMEOUT_S
        got = 0
        while True:
            try:
                got = pages()
            except Exception as exc:  # noqa: BLE001 - the directory restarting: look again
                log.info("chaos: the directory cannot say now: %s", exc)
            if got >= PROBE_PAGES or time.monotonic() >= deadline:
                return got
            time.sleep(0.2)


def record_probes(tally: Tally, probes: list[ProbeRecord], token_bytes) -> None:
    """Count the probes as requests: answered ones judged like the clients' (eos ignored),
    failed ones server errors. In the clients' thread."""
    for rec in probes:
        tally.sent += 1
        if rec.probe.error:
            tally.error(True, "probe", f"{rec.instance}: {rec.probe.error}", rec.at_s,
                        rec.done_s)
            continue
        tally.answered += 1
        tally.answers.append(Answer(AnswerKind.PROBE, (), PROBE_TOKENS, True,
                                    (tuple(token_bytes(t) for t in rec.probe.tokens),),
                                    rec.at_s, prompt=rec.prompt))


def _reused(probes: list) -> str:
    if not probes:
        return "its read did not end in time"
    probe = probes[0]
    if probe.error:
        return f"its read failed: {probe.error}"
    c = probe.cached
    return (f"it reused {c.device} L1, {c.host} L2, {c.storage} L3 and {c.peer} peer tokens")


def _signal(pids, sig: signal.Signals) -> bool:
    """Send `sig` to every pid; whether it reached them all."""
    ok = bool(pids)
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError as exc:
            log.warning("chaos: %s to pid %d failed: %s", sig.name, pid, exc)
            ok = False
    return ok


# ---- the graph, its start and its audit ---------------------------------------------------------
def vllm_chaos_settings(p: Any, tmp: str, admin_key: str) -> ServeSettings:
    """The graph of `p` (chaos.ChaosParams) over vLLM: two instances at `--tp` (default 1),
    blocks of 32 tokens (64 for a real model), a small L1 so that L2, L3 and peers serve,
    prefetches waiting a bounded time (`timeout`: a late read is given up on), a stall
    deadline for shared cores, the L3 (if any), its fault file and the namespace state under
    `tmp`."""
    tiny = p.model == "tiny"
    model = tiny_hf_dir(tmp) if tiny else p.model
    page = 32 if tiny else 64
    shared = p.l3 is not None or p.peers is not None  # the namespace actor runs
    settings = ServeSettings(engine="vllm", model=model, instances=2, tp_size=p.tp or 1,
                         page_size=page, chunk_tokens=4 * page,
                         device_pages=128 if tiny else 40, max_new_tokens=32, dtype=p.dtype,
                         storage_backend=p.l3.value if p.l3 is not None else "none",
                         peer_transport=p.peers, l3_root=f"{tmp}/l3" if shared else "",
                         l3_state_dir=f"{tmp}/l3-state" if shared else "",
                         l3_options={"fault_file": fault_file(tmp)} if p.l3 is not None else {},
                         l3_actor="kvtier-chaos-l3", hicache={"prefetch_policy": "timeout"},
                         stall_timeout_s=STALL_TIMEOUT_S, admin_key=admin_key)
    from kvtier.actors.serve_vllm import kv_heads

    heads = kv_heads(model_config(settings))
    if heads % settings.tp_size:
        raise ConfigError(f"--tp {settings.tp_size} does not divide the model's {heads} KV "
                          f"heads; give a divisor of {heads}")
    return settings


def model_config(settings: ServeSettings) -> dict:
    """The config.json of the model vLLM loads."""
    from kvtier.actors.serve_vllm import hf_config, model_dir

    return hf_config(model_dir(settings))


def fault_file(tmp: str) -> str:
    return os.path.join(tmp, "l3-faults.json")


def open_engines(settings: ServeSettings) -> Any:
    """The running graph's vLLM instances (actors.chaos_engines.EngineChaos)."""
    from kvtier.actors.chaos_engines import EngineChaos

    return EngineChaos(settings)


def warm_up(engines: Any, timeout_s: float) -> None:
    """A first request to each instance: its one-off warm-up (seconds) would otherwise pass
    the router's stall deadline with the first clients' requests."""
    for target in engines.targets:
        probe = engines.ask(target, list(range(1000, 1400)), PROBE_TOKENS, timeout_s)
        if probe.error:
            raise ConfigError(f"{target.name} did not answer its first request: {probe.error}")


class EngineAudits(NamedTuple):
    """The vLLM graph's leak audit once every instance is idle: KV blocks an engine holds
    with no request running, and L3 leases still open in the directory (a lookup's lease is
    released when its fetch ends; a killed engine's lapse after DIRECTORY_LEASE_S)."""

    leaked_pages: int
    leaked_locks: int
    idle: bool  # every instance ran no request when audited
    by_instance: dict[str, dict]
    open_tickets: int | None = None  # the connector's open L3 transfers: not reported yet

    @property
    def clean(self) -> bool:
        return self.idle and self.leaked_pages == 0 and self.leaked_locks == 0


def engine_audit(engines: Any) -> EngineAudits:
    """`engines` (actors.chaos_engines.EngineChaos) audited now."""
    audits = engines.audits()
    return EngineAudits(sum(a.blocks_in_use for a in audits.values()), engines.leases_active(),
                        all(a.idle for a in audits.values()),
                        {name: a._asdict() for name, a in audits.items()})
