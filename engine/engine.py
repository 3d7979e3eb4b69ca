"""Engine: the model, the hierarchical cache and the scheduler behind one small facade.

    config = HiCacheConfig(page_size=64)
    with Engine.smollm2(config, device_pages=256) as engine:
        (out,) = engine.generate(["The capital of France is"], SamplingParams(max_new_tokens=8))
        print(out.text, out.ttft_s, out.lengths.describe(), out.cached)
"""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Sequence

import torch

from kvtier.config import HiCacheConfig
from kvtier.dtypes import DType, resolve
from kvtier.engine.handoff import HandoffTarget, IncomingKV, check_handoff_spec
from kvtier.engine.handoff_desk import DEFAULT_HOLD_S, HandoffDesk, Reservation
from kvtier.engine.loader import load_smollm2_model
from kvtier.engine.model import PagedLlama
from kvtier.engine.request import Output, Request, Resume, pages_for
from kvtier.engine.runner import ModelRunner
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.scheduler import Scheduler, StepStats
from kvtier.engine.tokenizer import Tokenizer
from kvtier.errors import ClosedError, ConfigError
from kvtier.keys import check_cache_salt
from kvtier.policies import SchedulePolicy
from kvtier.tiers.device_pool import default_device
from kvtier.tiers.hierarchical_cache import HierarchicalCache

log = logging.getLogger(__name__)

Prompt = str | Sequence[int]
SMOLLM2_NAMESPACE = "SmolLM2-135M-Instruct"  # the L3 key namespace's model part
IDLE_WAIT_S = 0.0005  # a step that could do nothing waits on an L3 prefetch: don't spin hot
# A step that could do nothing while prefetches run blocks this long at most for one to end
# (GIL released): the storage thread then reads, verifies and sums without a step loop taking
# the GIL from it between its calls (a peer read in `bench instances --peer --tp 1` went from
# 24.8 to 15.5 ms, its verification from 7.7 to 4.7 ms, one run each). Ends when one ends.
PREFETCH_WAIT_S = 0.005
DEFAULT_CHUNK_TOKENS = 512  # prefill speed on CPU levels off around here (bench prefix)


def default_chunk_tokens(page_size: int) -> int:
    """The largest multiple of the page size up to DEFAULT_CHUNK_TOKENS (at least one page)."""
    return max(page_size, DEFAULT_CHUNK_TOKENS // page_size * page_size)


def engine_chunk_tokens(chunk_tokens: int | None, page_size: int, deterministic: bool,
                        token_budget: int) -> int:
    """The chunk an engine runs: deterministic mode computes one page per chunk (a hit on any
    page then lies on the grid), whatever was asked; by default the given size, or the
    default one within the step's token budget."""
    if deterministic:
        if chunk_tokens not in (None, page_size):
            log.info("deterministic mode: prefill chunks of one page (%d tokens), not %d",
                     page_size, chunk_tokens)
        return page_size
    if chunk_tokens is not None:
        return chunk_tokens
    return max(page_size, min(default_chunk_tokens(page_size),
                              token_budget // page_size * page_size))


def _check_pages_mode(cache: HierarchicalCache, deterministic: bool) -> None:
    """A cache whose pages are shared (an L3 attached) must be keyed in the engine's mode:
    a deterministic engine would otherwise read batched pages (and lose bit-identity), a
    default one would store batched pages where deterministic readers look. A private cache
    may differ: its pages never leave the engine."""
    if cache.l3_attached and cache.deterministic != deterministic:
        modes = {True: "deterministic", False: "default"}
        raise ConfigError(f"the engine runs in {modes[deterministic]} mode but its cache, with "
                          f"L3 attached, keys {modes[cache.deterministic]}-mode pages: build the "
                          f"HierarchicalCache with deterministic={deterministic}")


class Engine:
    """Requests in, outputs out: `add_request` + `step`, or `generate` for a whole batch.

    `chunk_tokens` (a multiple of the page size; default `default_chunk_tokens`) is the most
    new tokens one forward computes: several requests' prefill pieces and the decodes share
    it. A hit is reused down to any page boundary, and generated tokens' pages are cached.
    `deterministic=True` gives answers bit-identical to a cold run instead: prefill chunks of
    one page on an absolute grid, one sequence per forward, prompt pages only.
    `schedule_policy` orders admission (lpm: longest cached prefix first; fcfs).
    `token_budget` bounds the load-back, prefill and decode tokens of one step. The engine
    closes `cache` only when it created it (`Engine.smollm2`) or `owns_cache` says so.
    """

    def __init__(self, model: PagedLlama, cache: HierarchicalCache, chunk_tokens: int | None = None,
                 token_budget: int = 8192, max_load_pages: int | None = None,
                 tokenizer: Tokenizer | None = None, owns_cache: bool = False, *,
                 deterministic: bool = False,
                 schedule_policy: SchedulePolicy = SchedulePolicy.LPM) -> None:
        _check_pages_mode(cache, deterministic)
        self.model, self.cache, self.tokenizer = model, cache, tokenizer
        page = cache.spec.page_size
        chunk = engine_chunk_tokens(chunk_tokens, page, deterministic, token_budget)
        self.runner = ModelRunner(model, cache.device_pool, chunk,
                                  before_layer=cache.wait_layer, deterministic=deterministic)
        self.scheduler = Scheduler(cache, self.runner, token_budget, max_load_pages,
                                   policy=schedule_policy)
        self.handoffs = HandoffDesk(cache)  # decode side: pages reserved for hand-offs
        self._owns_cache = owns_cache
        self._next_id = 0  # the next id of a request added without one
        self._done: dict[int, Output] = {}  # finished inside generate(), not yet returned
        self._closed = False

    @classmethod
    def smollm2(cls, config: HiCacheConfig, device_pages: int = 256,
                dtype: torch.dtype | DType = DType.AUTO,
                device: torch.device | str | None = None,
                chunk_tokens: int | None = None, token_budget: int = 8192,
                tenant_salt: str = "", cache_dir: str | os.PathLike | None = None, *,
                deterministic: bool = False,
                schedule_policy: SchedulePolicy = SchedulePolicy.LPM) -> "Engine":
        """SmolLM2-135M-Instruct over a new HierarchicalCache built from `config` (its page
        size, tiers and L3 backend) with the model's KV geometry; CUDA when present. `dtype`
        AUTO is bf16 where the device computes in it, else fp32 (kvtier.dtypes)."""
        device = torch.device(device) if device is not None else default_device()
        model, tokenizer = load_smollm2_model(resolve(dtype, device), device, cache_dir=cache_dir)
        cache = HierarchicalCache(config, model.kv_spec(config.page_size), device_pages,
                                  device=model.device, model=SMOLLM2_NAMESPACE,
                                  tenant_salt=tenant_salt, deterministic=deterministic)
        try:
            return cls(model, cache, chunk_tokens, token_budget, tokenizer=tokenizer,
                       owns_cache=True, deterministic=deterministic,
                       schedule_policy=schedule_policy)
        except Exception:
            cache.close()
            raise

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt: Prompt, sampling: SamplingParams = SamplingParams(),
                    cache_salt: str = "", handoff_to: Sequence[HandoffTarget] = (),
                    resume: Resume | None = None, request_id: int | None = None) -> int:
        """Queue a prompt (text needs a tokenizer; token ids are used as given); its id
        (`request_id`: the caller's, which no request here may hold; else the next).
        `cache_salt`: its tenant (it hits only prefixes cached with the same salt).
        `handoff_to`: a prefill instance's request whose prompt KV goes to the decode ranks'
        reserved pages (every decode rank's target); it keeps its pages after it finishes
        until `release_handoff`. `resume`: the start of its answer the caller already has
        (the request ran before and lost its KV): it goes on after those tokens, which its
        output includes and its steps never report again (Request)."""
        req = self._request(prompt, sampling, cache_salt, request_id)
        if resume is not None and resume.tokens:
            if handoff_to:
                raise ConfigError("a hand-off's prefill starts an answer; it cannot resume "
                                  "one (serve a resumed request without a hand-off)")
            req.continue_after(resume, fold=not self.scheduler.deterministic)
        if handoff_to:
            check_handoff_spec(self.cache.spec)
            need = pages_for(len(req.prompt), self.cache.spec.page_size)
            for t in handoff_to:
                if len(t.pages) != need:
                    raise ConfigError(f"hand-off {t.handoff_id}: {len(t.pages)} reserved pages "
                                      f"for a {len(req.prompt)}-token prompt")
            req.handoff_to = tuple(handoff_to)
        self.scheduler.add(req)
        return req.id

    def add_received(self, prompt: Sequence[int], sampling: SamplingParams,
                     incoming: IncomingKV, cache_salt: str = "",
                     request_id: int | None = None) -> int:
        """Queue a decode request whose prompt KV a prefill rank wrote into the pages this
        engine reserved (`reserve_handoff`); it decodes from `incoming.first_token` once every
        rank has the pages whole, or is recomputed from its prompt (also when the
        reservation is gone)."""
        held = self.handoffs.take(incoming.handoff_id)
        if held is None or (tuple(held.pages), tuple(held.staged)) != \
                (tuple(incoming.pages), tuple(incoming.staged)):
            # Expired, cancelled, or this rank was replaced: it still queues as a hand-off
            # (every rank of the instance must), with no pages, so the ranks agree to
            # recompute it; a mismatched reservation is given back.
            log.warning("hand-off %s has no reservation here; the request is recomputed",
                        incoming.handoff_id)
            if held is not None:
                self.handoffs.free(held)
            incoming = incoming._replace(pages=(), staged=())
        req = self._request(prompt, sampling, cache_salt, request_id)
        req.incoming = incoming
        self.scheduler.add_received(req)
        return req.id

    def reserve_handoff(self, handoff_id: str, num_tokens: int,
                        hold_s: float = DEFAULT_HOLD_S, staged: bool = False
                        ) -> Reservation | None:
        """Decode side: L1 pages for a prompt of `num_tokens` a prefill rank will write, and
        L2 staging pages when it has another TP size (None: no room, serve it mixed)."""
        check_handoff_spec(self.cache.spec)
        if any(r.incoming is None for r in self.scheduler.waiting):
            # Requests wait here for L1 pages (recomputed, or resumed after a rank restart):
            # a reservation would take the pages they wait for, and new hand-offs would keep
            # taking them, so this one is served mixed on its prefill side.
            self.handoffs.refuse()
            return None
        return self.handoffs.reserve(handoff_id, num_tokens, hold_s, staged)

    def release_handoff(self, request_id: int) -> bool:
        """Prefill side: the decode side holds the request's KV; its pages join the cache."""
        return self.scheduler.release_handoff(request_id)

    def _request(self, prompt: Prompt, sampling: SamplingParams, cache_salt: str,
                 request_id: int | None) -> Request:
        if self._closed:
            raise ClosedError("the engine is closed; create a new Engine")
        tokens = tuple(self._encode(prompt))
        if not tokens:
            raise ConfigError("an empty prompt has no token to compute; give at least one")
        if sampling.stop_token_ids is None and self.tokenizer is not None:
            sampling = dataclasses.replace(sampling, stop_token_ids=self.tokenizer.stop_token_ids)
        if request_id is None:
            request_id = self._next_id
        elif self.scheduler.holds(request_id):
            raise ConfigError(f"request id {request_id} is held by a request of this engine; "
                              f"give each request its own")
        self._next_id = max(self._next_id, request_id + 1)
        return Request(request_id, tokens, sampling, self.model.device,
                       cache_salt=check_cache_salt(cache_salt))

    def step(self) -> list[Output]:
        """One scheduling step; the outputs of requests that finished in it (and of requests
        added with `add_request` that finished during a `generate` call)."""
        held, self._done = list(self._done.values()), {}
        self.handoffs.expire()  # reservations whose prefill never came
        self.scheduler.handoffs_reserved = self.handoffs.pending > 0
        return held + self._step()

    def _step(self) -> list[Output]:
        outputs = [self._output(r) for r in self.scheduler.step()]
        if self.scheduler.last_step.idle:  # only waiting on prefetches: let their thread run
            self.cache.await_prefetch(PREFETCH_WAIT_S)
        return outputs

    def abort(self, request_id: int) -> Output | None:
        """Stop a request wherever it is (waiting, prefetching, prefilling, decoding) and
        release all it holds; its output so far, or None if it is unknown or already done."""
        req = self.scheduler.abort(request_id)
        return None if req is None else self._output(req)

    @property
    def has_unfinished(self) -> bool:
        """Requests to run, or hand-off pages held (reservations, handed-off requests): the
        steps that release them when their time is up must keep coming."""
        return bool(self.scheduler.has_work or self.handoffs.pending or self.scheduler.handed)

    @property
    def last_step(self) -> StepStats:
        return self.scheduler.last_step

    def generate(self, prompts: Sequence[Prompt],
                 sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams()
                 ) -> list[Output]:
        """Run `prompts` to completion (batched continuously); outputs in prompt order."""
        params = list(sampling) if isinstance(sampling, Sequence) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise ConfigError(f"{len(params)} SamplingParams for {len(prompts)} prompts; give "
                              f"one, or one per prompt")
        ids = [self.add_request(p, s) for p, s in zip(prompts, params)]
        pending = set(ids)
        while pending & self._unreturned():
            for out in self._step():
                self._done[out.request_id] = out
            if self.last_step.idle:
                time.sleep(IDLE_WAIT_S)
        return [self._done.pop(i) for i in ids]

    def _unreturned(self) -> set[int]:
        return {r.id for r in self.scheduler.waiting + self.scheduler.running}

    # ---- text ------------------------------------------------------------------------------
    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ConfigError("a text prompt needs a tokenizer: pass tokenizer= to Engine, "
                                  "or give token ids")
            return self.tokenizer.encode_prompt(prompt)  # whole: BOS if the model wants one
        return [int(t) for t in prompt]

    def _output(self, req: Request) -> Output:
        text = None
        if self.tokenizer is not None:
            try:
                text = self.tokenizer.decode(list(req.answer))
            except Exception:  # noqa: BLE001 - this request's failure, not the engine's
                log.exception("request %d: its answer could not be turned into text", req.id)
                req.fail("its answer could not be turned into text")
        out = req.to_output(text)
        log.debug("request %d finished (%s): %d tokens, ttft %s s, %s", req.id,
                  out.finish_reason.value, len(out.tokens), out.ttft_s, out.lengths.describe())
        return out

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Abort what is unfinished (releasing its pages), then close the cache if owned."""
        if self._closed:
            return
        for req_id in sorted(self._unreturned()):
            self.scheduler.abort(req_id)
        for req_id in list(self.scheduler.handed):
            self.scheduler.release_handoff(req_id)
        self.handoffs.close()
        self._closed = True
        if self._owns_cache:
            self.cache.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
