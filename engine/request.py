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
from kvtier.tiers.storage_types import PrefetchSource, PrefetchTicket


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
    ERROR = "error"          # this request alone could not be computed (Output.error: why:
    # its next token could not be chosen, or its forwards kept reading KV that failed to
    # load); its batch-mates, the rank and the instance go on


class CachedTokens(NamedTuple):
    """Prompt tokens this request reused, by the tier they came from."""

    device: int   # L1
    host: int     # L2 (loaded back), not counting what L3 brought
    storage: int  # L3 (prefetched into L2, then loaded back)
    peer: int = 0  # another instance's L2 (prefetched into L2, then loaded back)

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage + self.peer


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
    prefill_logits: torch.Tensor | None = field(default=None, repr=False, compare=False,
                                                metadata={"wire": False})  # stays on the rank
    queue_s: float | None = None  # arrival to first admission (None: never admitted)
    # one per output token when the request asked for them (SamplingParams.logprobs)
    logprobs: tuple[TokenLogprob, ...] | None = None
    error: str | None = None  # FinishReason.ERROR: what failed, in words a client may read


class Resume(NamedTuple):
    """The start of an answer its caller already has (streamed to a client before the request
    lost its KV: its ranks were replaced, its instance stalled). The request continues after
    these tokens and never sends them again; `logprobs`, one per token, when it asked."""

    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


@dataclass(eq=False)
class Request:
    """Mutable scheduler state. `pages` is the page table: the first `num_shared` ids are the
    cache's (locked by `lookup`), the rest the request's own, freed or handed to the tree
    (default mode: a decoding request's first `committed_pages` are in the tree already).

    The answer is `resumed + output`. A request that loses its KV goes on from the answer it
    has, never from scratch (a recomputed answer in default mode need not be the same, and a
    client may have half of it): by default its answer so far joins its prompt (`fold`: their
    KV is recomputed as prompt, as vLLM does on preemption); in deterministic mode it runs
    again from its prompt, which gives the same tokens bit for bit, checked against `replay`
    (`restart`)."""

    id: int
    prompt: tuple[int, ...]
    params: SamplingParams
    device: torch.device | str = "cpu"  # where the sampler's generator lives (the model's)
    arrival_s: float = field(default_factory=time.perf_counter)
    ticket: PrefetchTicket | None = None
    storage_hit: int = 0  # tokens this request's L3 (and peer) prefetches put into L2
    peer_hit: int = 0  # of them, tokens read from a peer's L2
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
    resumed: tuple[int, ...] = ()  # answer tokens folded into `prompt` (its last ones)
    given_logprobs: tuple[TokenLogprob, ...] = ()  # a Resume's: for its first tokens
    replay: tuple[int, ...] = ()  # deterministic mode: the answer an earlier run gave,
    # which the recomputed one must repeat
    error: str | None = None  # FinishReason.ERROR: why
    sampler: Sampler = field(init=False)
    _state: RequestState = field(default=RequestState.WAITING, init=False)

    def __post_init__(self) -> None:
        self.sampler = Sampler(self.params, self.device, self.prompt)

    # ---- its state: changed only by the transitions below, each legal from given states ----
    @property
    def state(self) -> RequestState:
        return self._state

    def _move(self, to: RequestState, *legal: RequestState) -> None:
        assert self._state in legal, \
            f"request {self.id}: {self._state.name} -> {to.name} is not a legal transition"
        self._state = to

    def prefetched(self, source: PrefetchSource, tokens: int) -> None:
        """A prefetch of this request put `tokens` into L2 from `source`."""
        self.storage_hit += tokens
        if source is PrefetchSource.PEER:
            self.peer_hit += tokens

    def start_prefill(self, lookup: CacheLookup, pages: list[int], num_shared: int,
                      pos: int) -> None:
        """Admitted (WAITING -> PREFILLING): `pages` its page table, the first `num_shared`
        the cache's (locked by `lookup`); prefill goes on from prompt position `pos`."""
        self._move(RequestState.PREFILLING, RequestState.WAITING)
        self.lookup, self.pages, self.num_shared, self.pos = lookup, pages, num_shared, pos

    def start_decoding(self) -> None:
        """Its prompt is computed (PREFILLING -> DECODING): its first token comes next."""
        self._move(RequestState.DECODING, RequestState.PREFILLING)

    def adopt(self, lookup: CacheLookup, pages: list[int]) -> None:
        """A decode side's hand-off (WAITING -> DECODING): `pages` (all its own) hold its
        whole prompt's KV, written by a prefill rank."""
        self._move(RequestState.DECODING, RequestState.WAITING)
        self.lookup, self.pages, self.num_shared, self.pos = lookup, pages, 0, len(self.prompt)

    def finish(self, reason: FinishReason | None) -> None:
        """Ended (from any state but FINISHED), for `reason`."""
        self._move(RequestState.FINISHED, RequestState.WAITING, RequestState.PREFILLING,
                   RequestState.DECODING, RequestState.RETRACTED)
        self.finish_reason = reason
        self.finish_s = time.perf_counter()

    @property
    def asked(self) -> tuple[int, ...]:
        """The prompt the caller gave (without folded answer tokens)."""
        return self.prompt[:len(self.prompt) - len(self.resumed)]

    @property
    def answer(self) -> tuple[int, ...]:
        """Every token of its answer so far, the folded ones first."""
        return self.resumed + tuple(self.output)

    def tail(self, n: int) -> tuple[tuple[int, ...], tuple[TokenLogprob, ...] | None]:
        """The answer's last `n` tokens and their log-probabilities (those it has: the
        log-probabilities always belong to the answer's last tokens), without copying the
        rest: what a step reports as new."""
        out = self.output
        tokens = tuple(out[len(out) - n:]) if n <= len(out) else self.answer[-n:]
        if self.params.logprobs is None:
            return tokens, None
        mine = self.sampler.logprobs
        lps = tuple(mine[len(mine) - n:]) if n <= len(mine) else \
            (self.given_logprobs + tuple(mine))[-n:]
        return tokens, lps

    def continue_after(self, resume: Resume, fold: bool) -> None:
        """Start after an answer the caller already has (a new request: nothing computed).
        `fold` (default mode): the tokens join the prompt; else they are replayed."""
        if not resume.tokens:
            return
        if fold:
            self.prompt, self.resumed = self.prompt + resume.tokens, resume.tokens
            self.given_logprobs = tuple(resume.logprobs or ())
        else:
            self.replay = resume.tokens
        self.sampler = Sampler(self.params, self.device, self.asked, self.resumed)

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

    @property
    def done(self) -> bool:
        """Its answer is complete already (a Resume may bring all of it)."""
        answer = self.answer
        return len(answer) >= self.params.max_new_tokens or \
            any(t in self.params.stops for t in answer)

    def append(self, token: int) -> bool:
        """Record a sampled token; True when it ends the request."""
        if self.first_token_s is None:
            self.first_token_s = time.perf_counter()
        at = len(self.resumed) + len(self.output)
        if at >= self.params.max_new_tokens:  # a continuation whose answer was complete
            self.finish_reason = FinishReason.LENGTH
            return True
        if at < len(self.replay) and token != self.replay[at]:
            self.fail(f"its answer was recomputed after its KV was lost and differs at token "
                      f"{at} from the one already given")
            return True
        self.output.append(token)
        if token in self.params.stops:
            self.finish_reason = FinishReason.STOP
        elif at + 1 >= self.params.max_new_tokens:
            self.finish_reason = FinishReason.LENGTH
        return self.finish_reason is not None

    def fail(self, why: str) -> None:
        """End this request alone: what its client is told (FinishReason.ERROR)."""
        self.finish_reason, self.error = FinishReason.ERROR, why

    def _unhold(self) -> None:
        """Preempted (PREFILLING, DECODING or RETRACTED -> WAITING), holding nothing."""
        self._move(RequestState.WAITING, RequestState.PREFILLING, RequestState.DECODING,
                   RequestState.RETRACTED)
        self.lookup, self.pages, self.num_shared, self.pos = None, [], 0, 0
        self.committed_pages = 0
        self.prefill_logits = None

    def fold(self) -> None:
        """Back to WAITING with nothing held (preempted, default mode), keeping its answer:
        the tokens so far join the prompt (their KV is recomputed with it) and it goes on
        after them; its sampler keeps counting and seeding from where it is."""
        self._unhold()
        self.prompt += tuple(self.output)
        self.resumed += tuple(self.output)
        self.output = []

    def restart(self) -> None:
        """Back to WAITING with nothing held (preempted, deterministic mode): it runs again
        from its prompt and must give the same answer (`replay`), which per-position seeds
        and bit-identical KV make so; its first token's time stays the first run's."""
        self._unhold()
        if len(self.answer) > len(self.replay):
            self.replay = self.answer
        self.output = []
        self.sampler = Sampler(self.params, self.device, self.asked, self.resumed)

    def retract(self) -> None:
        """Out of L1, holding nothing there, its KV kept elsewhere (engine.retraction): it
        keeps its output and sampler, and `resume` goes on decoding where it stopped."""
        self._move(RequestState.RETRACTED, RequestState.DECODING)
        self.lookup, self.pages, self.num_shared = None, [], 0
        self.committed_pages = 0

    def resume(self, lookup: CacheLookup, pages: list[int]) -> None:
        """Back in L1 after `retract`: `pages` (all its own) hold its KV again."""
        self._move(RequestState.DECODING, RequestState.RETRACTED)
        self.lookup, self.pages = lookup, pages

    def to_output(self, text: str | None = None) -> Output:
        ttft = None if self.first_token_s is None else self.first_token_s - self.arrival_s
        rate = None
        if self.first_token_s is not None and self.finish_s is not None and len(self.output) > 1:
            elapsed = self.finish_s - self.first_token_s
            rate = (len(self.output) - 1) / elapsed if elapsed > 0 else None
        assert self.finish_reason is not None
        queue = None if self.admitted_s is None else self.admitted_s - self.arrival_s
        return Output(self.id, self.asked, self.answer, text, self.finish_reason,
                      self.lengths, self.cached, ttft, rate, self.prefill_logits, queue,
                      self.logprobs, self.error)

    @property
    def logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """Its answer's log-probabilities so far, one per token (None when it did not ask
        for them); a Resume without them leaves its tokens' out."""
        if self.params.logprobs is None:
            return None
        return self.given_logprobs + tuple(self.sampler.logprobs)
