"""One request's life in the engine: its state, what it holds in the cache, and its result."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvtier.engine.handoff import HandoffTarget, IncomingKV
from kvtier.engine.sampling import Sampler, SamplingParams, TokenLogprob
from kvtier.tiers.cache_types import CacheLookup, RequestLengths
from kvtier.tiers.storage_types import PrefetchTicket


class RequestState(enum.Enum):
    WAITING = "waiting"        # queued; may have an L3 prefetch in flight
    PREFILLING = "prefilling"  # admitted: holds a locked lookup and its own pages
    DECODING = "decoding"      # prompt done, generating one token per step
    RETRACTED = "retracted"    # decoding, pushed out of L1: its KV in L2 (engine.retraction)
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"            # sampled a stop token (it ends `tokens`)
    LENGTH = "length"        # reached max_new_tokens
    ABORTED = "aborted"      # the caller aborted it
    NO_MEMORY = "no_memory"  # L1 cannot hold the sequence even with nothing else running
    ERROR = "error"          # its forwards kept reading KV that failed to load (see the log)


class CachedTokens(NamedTuple):
    """Prompt tokens this request reused, by the tier they came from."""

    device: int   # L1
    host: int     # L2 (loaded back), not counting what L3 brought
    storage: int  # L3 (prefetched into L2, then loaded back)

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


@dataclass(frozen=True)
class Output:
    """A finished request. `prefill_logits` (float32, CPU) are the last prompt token's logits."""

    request_id: int
    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    text: str | None
    finish_reason: FinishReason
    lengths: RequestLengths
    cached: CachedTokens
    ttft_s: float | None
    decode_tokens_per_s: float | None
    prefill_logits: torch.Tensor | None = field(default=None, repr=False, compare=False)
    queue_s: float | None = None  # arrival to first admission (None: never admitted)
    # one per output token when the request asked for them (SamplingParams.logprobs)
    logprobs: tuple[TokenLogprob, ...] | None = None


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(eq=False)
class Request:
    """Mutable scheduler state. `pages` is the page table: the first `num_shared` ids are the
    cache's (locked by `lookup`), the rest the request's own, freed or handed to the tree
    (default mode: a decoding request's first `committed_pages` are in the tree already)."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    device: torch.device | str = "cpu"  # where the sampler's generator lives (the model's)
    arrival_s: float = field(default_factory=time.perf_counter)
    state: RequestState = RequestState.WAITING
    ticket: PrefetchTicket | None = None
    storage_hit: int = 0  # tokens this request's L3 prefetches put into L2
    prefetch_asked_s: float = 0.0  # when this rank last asked L3 for its prompt (monotonic)
    lookup: CacheLookup | None = None
    pages: list[int] = field(default_factory=list)
    num_shared: int = 0
    committed_pages: int = 0  # whole pages handed to the tree while it runs (cache.commit)
    pos: int = 0  # next prompt position to prefill
    output: list[int] = field(default_factory=list)
    lengths: RequestLengths = RequestLengths(0, 0, 0, 0, 0)
    cached: CachedTokens = CachedTokens(0, 0, 0)
    prefill_logits: torch.Tensor | None = None
    first_token_s: float | None = None
    admitted_s: float | None = None  # the first admission (a preempted restart keeps it)
    finish_s: float | None = None
    finish_reason: FinishReason | None = None
    agreed_hit: int = 0  # prompt tokens every rank held in L1/L2 at the last agreement
    waited_steps: int = 0  # scheduling steps spent waiting (the lpm aging bound counts them)
    cache_salt: str = ""  # its tenant's: it hits only prefixes cached under the same salt
    handoff_to: tuple[HandoffTarget, ...] = ()  # prefill side: every decode rank's pages
    # its prompt's KV goes to (this rank writes to those holding its heads)
    incoming: IncomingKV | None = None  # decode side: its prompt's KV, written by a prefill rank
    kv_ready_s: float | None = None  # decode side: when every rank agreed its KV arrived
    sampler: Sampler = field(init=False)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params, self.device, self.prompt)

    @property
    def own_pages(self) -> list[int]:
        return self.pages[self.num_shared:]

    @property
    def kv_len(self) -> int:
        """Positions whose KV is in `pages`: the prompt and every output token but the last."""
        return len(self.prompt) + len(self.output) - 1

    @property
    def computed(self) -> tuple[int, ...]:
        """The tokens whose KV is in `pages` once decoding (prompt + output but the last)."""
        return self.prompt + tuple(self.output[:-1])

    def append(self, token: int) -> bool:
        """Record a sampled token; True when it ends the request."""
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        self.output.append(token)
        if token in self.params.stops:
            self.finish_reason = FinishReason.STOP
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None

    def reset(self) -> None:
        """Back to WAITING with nothing held (after preemption): it restarts from its prompt,
        and a fresh sampler with the same seed makes the restart reproduce its tokens."""
        self.state, self.lookup, self.pages, self.num_shared, self.pos = \
            RequestState.WAITING, None, [], 0, 0
        self.committed_pages = 0
        self.output, self.prefill_logits, self.first_token_s = [], None, None
        self.sampler = Sampler(self.params, self.device, self.prompt)

    def retract(self) -> None:
        """Out of L1, holding nothing there, its KV kept elsewhere (engine.retraction): it
        keeps its output and sampler, and `resume` goes on decoding where it stopped."""
        self.state, self.lookup, self.pages, self.num_shared = \
            RequestState.RETRACTED, None, [], 0
        self.committed_pages = 0

    def resume(self, lookup: CacheLookup, pages: list[int]) -> None:
        """Back in L1 after `retract`: `pages` (all its own) hold its KV again."""
        self.state, self.lookup, self.pages = RequestState.DECODING, lookup, pages

    def to_output(self, text: str | None = None) -> Output:
        ttft = None if self.first_token_s is None else self.first_token_s - self.arrival_s
        rate = None
        if self.first_token_s is not None and self.finish_s is not None and len(self.output) > 1:
            elapsed = self.finish_s - self.first_token_s
            rate = (len(self.output) - 1) / elapsed if elapsed > 0 else None
        assert self.finish_reason is not None
        queue = None if self.admitted_s is None else self.admitted_s - self.arrival_s
        return Output(self.id, self.prompt, tuple(self.output), text, self.finish_reason,
                      self.lengths, self.cached, ttft, rate, self.prefill_logits, queue,
                      self.logprobs)

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """Its output tokens' log-probabilities so far (None when it did not ask for them)."""
        return None if self.params.logprobs is None else tuple(self.sampler.logprobs)
