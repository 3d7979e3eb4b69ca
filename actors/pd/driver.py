"""Prefill/decode disaggregation over Instances: each request is prefilled on a prefill
instance and decoded on a decode instance that received its prompt's KV.

    with PDDriver([prefill], [decode], transport="nixl") as pd:
        (out,) = pd.generate([prompt], SamplingParams(max_new_tokens=16))
        out.tokens, out.mode, out.stages      # HandoffStages: the time of each stage

Per request (`add`, then `step` until it is returned; `step_report` also gives the tokens of
the requests that grew, for streaming; `abort` stops one wherever it is):
  bootstrap  the least loaded decode instance (then the one holding most of the prompt)
             reserves L1 pages for the prompt on every rank; none has room, or the request
             asks for one token only (its prefill ends it: no KV to move), the request is
             served mixed on a prefill instance (mode MIXED)
  prefill    the prefill instance holding most of the prompt (then the least loaded)
             computes the rest of it and samples the first token: TTFT
  transfer   its ranks write the prompt's pages into the reserved ones (in the same step)
  KV-ready   the decode instance's ranks verify every page and agree; the prefill side then
             releases its pages (they stay in its cache as prefixes)
  decode     the decode instance continues from the second token
A transfer that failed, or pages some decode rank found corrupt, make the decode instance
recompute the request from its prompt (mode RECOMPUTED); a decode instance whose ranks were
replaced recomputes its requests the same way; a prefill instance whose ranks were replaced
prefills again into the same reservation. Every call the driver makes to an instance
recovers that instance when one of its ranks fails in it (Instance._recovering), so a dead
rank costs its own instance a restart and its requests a recomputation, never anyone else's
answer. Nothing is lost, and the answer is the one a mixed instance gives.

A write that failed or timed out may still be running in the transport: its reservation
lingers (`linger_s`) before its pages go back, whether the request goes on or not.
"""
from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

from kvtier.actors.instance import Instance, InstanceError, InstanceStep
from kvtier.actors.step_wire import Progress
from kvtier.engine.handoff import HandoffSent, HandoffStages, HandoffTarget
from kvtier.engine.handoff_desk import DEFAULT_HOLD_S, FAILED_WRITE_LINGER_S
from kvtier.engine.request import CachedTokens, FinishReason, Output, Resume
from kvtier.engine.sampling import SamplingParams, TokenLogprob
from kvtier.errors import ConfigError
from kvtier.tiers.cache_types import RequestLengths

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.0005


class PDMode(enum.Enum):
    HANDOFF = "handoff"        # decoded over the KV its prefill instance sent
    RECOMPUTED = "recomputed"  # the hand-off failed: the decode instance computed the prompt
    MIXED = "mixed"            # one instance did it all (no decode instance had room, or
    # only one token was asked for)


class PDOutput(NamedTuple):
    request_id: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    finish_reason: FinishReason
    mode: PDMode
    stages: HandoffStages
    ttft_s: float | None     # arrival to the first token (the prefill instance samples it)
    cached: CachedTokens     # the prompt tokens the prefill side reused, by tier
    lengths: RequestLengths  # the prefill side's five lengths
    transfer_bytes: int = 0  # over every rank
    prefill_instance: int = -1
    decode_instance: int = -1
    transfer_pages: int = 0  # prompt pages written (each over every rank)
    queue_s: float | None = None  # the prefill side's arrival to first admission
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, when it asked
    error: str | None = None  # FinishReason.ERROR: why this request failed


class PDStep(NamedTuple):
    finished: list[PDOutput]
    progress: dict[int, Progress]  # requests whose answer grew: the new tokens (the first
    # once the prefill instance sampled it, then the decode instance's)


@dataclass
class _Flight:
    """One request on its way through the stages."""

    id: int
    tokens: tuple[int, ...]
    sampling: SamplingParams
    salt: str
    label: str = ""  # its id as its client knows it: each instance it runs on is given it
    arrival_s: float = field(default_factory=time.perf_counter)
    mode: PDMode = PDMode.HANDOFF
    handoff_id: str = ""
    targets: list[HandoffTarget] | None = None
    prefill: int = -1   # instance index
    decode: int = -1
    pid: int | None = None  # its id (f.id) on the prefill instance, once added there
    did: int | None = None  # its id (f.id) on the decode instance, once added there
    stages: dict = field(default_factory=dict)
    prefill_out: Output | None = None
    first_token_s: float | None = None
    added_to_decode_s: float | None = None
    kv_ready_s: float | None = None
    transfer_bytes: int = 0
    transfer_pages: int = 0
    sent: int = 0  # answer tokens passed on (step_report's progress)

    @property
    def name(self) -> str:
        """How the logs name it: its client's id, else its own."""
        return self.label or str(self.id)


class PDDriver:
    """Prefill instances and decode instances, stepped together. With equal TP sizes each
    prefill rank writes L1 pages into its decode rank's; with different ones every hand-off
    is staged through L2 in `page_head`, head object by head object."""

    def __init__(self, prefill: Sequence[Instance], decode: Sequence[Instance],
                 transport: str = "nixl", hold_s: float = DEFAULT_HOLD_S,
                 linger_s: float = FAILED_WRITE_LINGER_S) -> None:
        """`hold_s`: how long a decode reservation waits for its prefill; `linger_s`: how
        long pages a failed write targeted stay held (the write may still be running)."""
        if not prefill or not decode:
            raise ConfigError("prefill/decode disaggregation needs at least one prefill and "
                              "one decode instance")
        self.prefill, self.decode = list(prefill), list(decode)
        self.hold_s, self.linger_s = hold_s, linger_s
        self.staged = len({inst.size for inst in [*prefill, *decode]}) > 1
        for inst in [*self.prefill, *self.decode]:
            inst.handoff_open(transport, self.staged)
        self._ids = itertools.count()
        self._flights: dict[int, _Flight] = {}
        self._by_pid: dict[tuple[int, int], _Flight] = {}
        self._by_did: dict[tuple[int, int], _Flight] = {}
        self._done: list[PDOutput] = []
        self._progress: dict[int, Progress] = {}  # this step's, by request id

    # ---- requests --------------------------------------------------------------------------
    def add(self, tokens: Sequence[int], sampling: SamplingParams = SamplingParams(),
            cache_salt: str = "", resume: Resume | None = None,
            request_id: int | None = None, label: str = "") -> int:
        """Queue a request; its id (`request_id`: a server's own, instead of the next;
        `label`: its id as its client knows it, given to the instances it runs on).
        `resume`: the start of its answer the caller already has (it ran elsewhere): it is
        served mixed on a prefill instance, going on after it."""
        if request_id is None:
            request_id = next(self._ids)
        elif request_id in self._flights:
            raise ConfigError(f"request id {request_id} is in flight; give each request its "
                              f"own")
        f = _Flight(request_id, tuple(int(t) for t in tokens), sampling, cache_salt, label)
        self._flights[f.id] = f
        f.prefill = self._pick_prefill(f)
        if resume is not None and resume.tokens:
            f.mode, f.sent = PDMode.MIXED, len(resume.tokens)
            f.pid = self.prefill[f.prefill].add_request(f.tokens, sampling, cache_salt, resume,
                                                        request_id=f.id, label=label)
            self._by_pid[(f.prefill, f.pid)] = f
            return f.id
        if sampling.max_new_tokens > 1:  # else its prefill ends it: no KV to move
            start = time.perf_counter()
            f.handoff_id = f"pd-{uuid.uuid4().hex[:12]}-{f.id}"
            f.decode, f.targets = self._bootstrap(f)
            f.stages["bootstrap_s"] = time.perf_counter() - start
            if f.targets is None:
                log.info("request %s: no decode instance has room; serving it mixed", f.name)
        inst = self.prefill[f.prefill]
        if f.targets is None:
            f.mode = PDMode.MIXED
            f.pid = inst.add_request(f.tokens, sampling, cache_salt, request_id=f.id,
                                     label=label)
        else:
            first_only = dataclasses.replace(sampling, max_new_tokens=1)
            f.pid = inst.add_prefill(f.tokens, first_only, f.targets, cache_salt,
                                     request_id=f.id, label=label)
        self._by_pid[(f.prefill, f.pid)] = f
        return f.id

    def _pick_prefill(self, f: _Flight) -> int:
        """The prefill instance holding most of the prompt in L1/L2 (it reuses it), then the
        least loaded."""
        if len(self.prefill) == 1:
            return 0
        return min(range(len(self.prefill)),
                   key=lambda i: (-self._held(self.prefill[i], f), self.prefill[i].num_pending))

    def _held(self, inst: Instance, f: _Flight) -> int:
        """Whole pages of the prompt every rank of `inst` holds in L1 or L2 (0 when its ranks
        fail: they are replaced)."""
        return inst.prompt_pages_held(f.tokens, f.salt)

    def _bootstrap(self, f: _Flight) -> tuple[int, list[HandoffTarget] | None]:
        """The least loaded decode instance (then the one holding most of the prompt: its
        conversation's earlier turns, for its next turn's cache) that can reserve the
        prompt's pages (one whose ranks fail is passed over: they are replaced)."""
        if len(self.decode) == 1:
            order = [0]
        else:
            order = sorted(range(len(self.decode)),
                           key=lambda i: (self.decode[i].num_pending,
                                          -self._held(self.decode[i], f)))
        for i in order:
            targets = self.decode[i].reserve_handoff(f.handoff_id, len(f.tokens), self.hold_s,
                                                     self.staged)
            if targets is not None:
                return i, targets
        return -1, None

    def abort(self, request_id: int) -> bool:
        """Stop a request wherever it is, freeing what it holds on either side (the decode
        reservation, the prefill side's handed-off pages); False when it is not in flight."""
        f = self._flights.pop(request_id, None)
        if f is None:
            return False
        self._progress.pop(f.id, None)
        if self._by_pid.pop((f.prefill, f.pid), None) is not None:
            prefill = self.prefill[f.prefill]
            prefill.abort(f.pid)
            if f.mode is not PDMode.MIXED:
                self.decode[f.decode].cancel_handoff(f.handoff_id)
                prefill.release_handoff(f.pid)
        elif self._by_did.pop((f.decode, f.did), None) is not None:
            self.decode[f.decode].abort(f.did)  # its received pages too
            if f.mode is PDMode.HANDOFF and f.kv_ready_s is None:
                self.prefill[f.prefill].release_handoff(f.pid)
        return True

    def step(self) -> list[PDOutput]:
        """Step every instance once; the requests that finished."""
        return self.step_report().finished

    def step_report(self) -> PDStep:
        """`step`, with the output so far of the requests that grew."""
        for i, inst in enumerate(self.prefill):
            self._on_prefill_step(i, inst.step_report())
        for i, inst in enumerate(self.decode):
            self._on_decode_step(i, inst.step_report())
        done, self._done = self._done, []
        progress, self._progress = self._progress, {}
        return PDStep(done, progress)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams = SamplingParams(),
                 max_steps: int = 100_000) -> list[PDOutput]:
        ids = [self.add(p, sampling) for p in prompts]
        got: dict[int, PDOutput] = {}
        for _ in range(max_steps):
            if len(got) == len(ids):
                break
            outs = self.step()
            got.update((o.request_id, o) for o in outs)
            if not outs:
                time.sleep(IDLE_WAIT_S)
        else:
            raise InstanceError(f"requests {sorted(set(ids) - set(got))} unfinished after "
                                f"{max_steps} steps; raise max_steps")
        return [got[i] for i in ids]

    # ---- stages ----------------------------------------------------------------------------
    def _on_prefill_step(self, index: int, step: InstanceStep) -> None:
        now = time.perf_counter()
        for out in step.finished:
            f = self._by_pid.pop((index, out.request_id), None)
            if f is None:
                continue
            f.first_token_s = f.first_token_s or now
            if f.mode is PDMode.MIXED:
                self._finish(f, out, out)
                continue
            f.prefill_out = out
            f.stages["prefill_s"] = now - f.arrival_s - f.stages["bootstrap_s"]
            self._after_prefill(f, out, step.handoffs.get(out.request_id, []))
        for req_id, progress in step.progress.items():
            f = self._by_pid.get((index, req_id))
            if f is not None and f.first_token_s is None:
                f.first_token_s = now  # a mixed request's first token
            if f is not None and f.mode is PDMode.MIXED:
                self._emit(f, progress)

    def _after_prefill(self, f: _Flight, out: Output, sent: list[HandoffSent]) -> None:
        decode, prefill = self.decode[f.decode], self.prefill[f.prefill]
        if out.finish_reason is not FinishReason.LENGTH or f.sampling.max_new_tokens <= 1:
            # the first token ended it (a stop token: nothing was sent); a write that failed
            # may still be running, so its pages linger as on the recompute path below
            clean = all(s.ok for s in sent)
            decode.cancel_handoff(f.handoff_id, 0.0 if clean else self.linger_s)
            prefill.release_handoff(out.request_id)
            self._finish(f, out, out)
            return
        f.transfer_bytes = sum(s.bytes for s in sent)
        if sent:
            f.stages["transfer_s"] = max(s.seconds for s in sent)
            if all(s.ok for s in sent) and f.targets:
                f.transfer_pages = len(f.targets[0].pages)  # one per prompt page
        first = out.logprobs[:1] if out.logprobs is not None else None
        self._emit(f, Progress(0, out.tokens[:1], first))  # streamed before decode
        f.added_to_decode_s = time.perf_counter()
        if len(sent) == prefill.size and all(s.ok for s in sent):
            f.did = decode.add_received(f.tokens, f.sampling, sent, f.targets, out.tokens[0],
                                        f.salt, first[0] if first else None, request_id=f.id,
                                        label=f.label)
        else:
            why = "; ".join(s.error for s in sent if not s.ok) or "no transfer reported"
            log.warning("request %s: the hand-off failed (%s); the decode instance "
                        "recomputes it", f.name, why)
            f.mode = PDMode.RECOMPUTED
            decode.cancel_handoff(f.handoff_id, self.linger_s)
            prefill.release_handoff(out.request_id)
            # it goes on after the first token, which its client may have already
            f.did = decode.add_request(f.tokens, f.sampling, f.salt,
                                       Resume(out.tokens[:1], first), request_id=f.id,
                                       label=f.label)
        self._by_did[(f.decode, f.did)] = f

    def _on_decode_step(self, index: int, step: InstanceStep) -> None:
        now = time.perf_counter()
        for req_id, progress in step.progress.items():
            f = self._by_did.get((index, req_id))
            if f is not None:
                self._on_decode_progress(f, progress.stop, now)
                self._emit(f, progress)
        for out in step.finished:
            f = self._by_did.pop((index, out.request_id), None)
            if f is not None:
                self._on_decode_progress(f, len(out.tokens), now)
                if f.mode is PDMode.HANDOFF and out.lengths.extend_len:
                    f.mode = PDMode.RECOMPUTED  # some decode rank lacked a page, or its ranks
                    # were replaced: it computed the prompt itself
                self._finish(f, f.prefill_out or out, out)

    def _on_decode_progress(self, f: _Flight, tokens: int, now: float) -> None:
        if f.kv_ready_s is None and tokens >= 1:
            f.kv_ready_s = now
            f.stages["kv_ready_s"] = now - (f.added_to_decode_s or now)
            if f.mode is PDMode.HANDOFF:  # the decode ranks have it: free the prefill side
                self.prefill[f.prefill].release_handoff(f.pid)
        if "decode_queue_s" not in f.stages and tokens >= 2:
            f.stages["decode_queue_s"] = now - f.kv_ready_s

    def _emit(self, f: _Flight, progress: Progress) -> None:
        """Pass on what `progress` adds to what the flight's caller has (this step's)."""
        new = progress.after(f.sent)
        if new is None:
            return
        old = self._progress.get(f.id)
        if old is not None:  # two in one step (the prefill side's first token, then more)
            lps = None if old.logprobs is None or new.logprobs is None \
                else old.logprobs + new.logprobs
            new = Progress(old.start, old.tokens + new.tokens, lps)
        self._progress[f.id] = new
        f.sent = new.stop

    def _finish(self, f: _Flight, first: Output, last: Output) -> None:
        if f.mode is not PDMode.MIXED:  # its prefill side's pages, if the decode side never
            self.prefill[f.prefill].release_handoff(f.pid)  # said (no token: no KV-ready)
        del self._flights[f.id]
        self._progress.pop(f.id, None)
        ttft = None if f.first_token_s is None else f.first_token_s - f.arrival_s
        self._done.append(PDOutput(
            f.id, f.tokens, last.tokens, last.finish_reason, f.mode,
            HandoffStages(**f.stages), ttft, first.cached, first.lengths, f.transfer_bytes,
            f.prefill, f.decode, f.transfer_pages, first.queue_s, last.logprobs, last.error))

    # ---- lifetime ----------------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return len(self._flights)

    @property
    def restarts(self) -> int:
        """Rank sets replaced over every instance's life."""
        return sum(inst.restarts for inst in [*self.prefill, *self.decode])

    def close(self) -> None:
        """Close every instance."""
        for inst in [*self.prefill, *self.decode]:
            inst.close()

    def __enter__(self) -> "PDDriver":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
