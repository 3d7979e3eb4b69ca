"""The clients of `kvtier bench chaos`, over HTTP against the serve graph: conversations (real
multi-turn chat about a few shared documents, greedy, half of the requests streamed), the
adversary (random bodies with extreme values, streams cancelled midway, `n` 16 with
`top_logprobs` 20 at the token limit), and two tenants (`cache_salt`) asking the same new
document, the second of which must be told 0 cached tokens (`tenant_shared_tokens`).

Every greedy request of a conversation or of the `n` 16 kind asks for its log-probabilities:
they carry each answer token's bytes, which is how the answers (streamed ones token by token,
as the client saw them) are judged against cold runs after the traffic (bench/cold_judge.py).
Everything is bounded: each request by `request_timeout_s`, the traffic by its deadline and
`max_requests`; a conversation whose request failed starts over (its history is gone).
"""
from __future__ import annotations

import asyncio
import enum
import json
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp

from kvtier.bench.chaos_bodies import CHAT, COMPLETIONS, Limits, adversarial_body
from kvtier.bench.serve_load import WORDS, ServerError, check_status, sse_chunks

ERROR_BYTES = 64 << 10  # a server error's whole message: its cause comes last
ANSI = re.compile(r"\x1b\[[0-9;]*m")
MALFORMED = (ValueError, KeyError, TypeError, IndexError)  # a body or chunk that is no answer


class AnswerKind(enum.Enum):
    CHAT = "chat"  # a conversation's turn, answered whole
    STREAM = "chat_stream"  # a conversation's turn, streamed
    N16 = "n16"  # n 16, top_logprobs 20, max_tokens at the server's limit, eos ignored
    PROBE = "probe"  # a fault's own request to one instance (bench/chaos_vllm.py), eos ignored


class Answer(NamedTuple):
    """A well-formed greedy request and what came back: what is judged after the run."""

    kind: AnswerKind
    messages: tuple[dict, ...]
    max_tokens: int
    ignore_eos: bool
    choices: tuple[tuple[bytes, ...], ...]  # each answer's tokens, as their bytes
    at_s: float  # when it was sent, from the start of the traffic
    prompt: tuple[int, ...] | None = None  # a prompt of token ids (a probe's) for `messages`


class ClientParams(NamedTuple):
    conversations: int = 3  # clients, each holding one conversation at a time
    rounds: int = 3
    doc_words: int = 200  # words of each shared document (a conversation's system prompt)
    docs: int = 3
    turn_words: int = 20
    answer_tokens: int = 16
    n16_every_s: float = 15.0
    tenant_every_s: float = 10.0  # a new document for the two tenants
    fuzz_pause_s: float = 0.2
    error_pause_s: float = 1.0  # a client whose request failed waits this long, as people do
    request_timeout_s: float = 120.0
    max_requests: int = 100_000
    seed: int = 0


class ErrorRecord(NamedTuple):
    """One request that got an error: when it was sent and when the error came (seconds from
    the start of the traffic), what kind, whether the body was well-formed, and the cause."""

    sent_s: float
    failed_s: float
    kind: str
    well_formed: bool
    cause: str


@dataclass
class Tally:
    sent: int = 0
    answered: int = 0
    refused_4xx: int = 0
    cancelled: int = 0  # streams the client cut midway
    errors: list = field(default_factory=list)  # ErrorRecord, in the order they came
    answers: list = field(default_factory=list)
    adversarial_answered: int = 0
    statuses: Counter = field(default_factory=Counter)  # adversarial bodies: HTTP status
    tenant_probes: int = 0  # documents tenant B asked after tenant A cached them
    tenant_moved: int = 0  # of those: B's answer moved instances (may hit its own first run)
    tenant_shared_tokens: int = 0  # cached tokens B was told, not moved: another's pages

    def error(self, well_formed: bool, kind: str, detail: str, sent_s: float,
              failed_s: float) -> None:
        self.errors.append(ErrorRecord(sent_s, failed_s, kind, well_formed, error_cause(detail)))

    @property
    def server_errors(self) -> int:
        """Well-formed requests that got an error."""
        return sum(e.well_formed for e in self.errors)

    @property
    def adversarial_server_errors(self) -> int:
        """Adversarial bodies answered with a 5xx or not at all."""
        return sum(not e.well_formed for e in self.errors)


def error_cause(detail: str, chars: int = 400) -> str:
    """The end of an error message (an OpenAI error body's message when it is one): a
    server error's traceback ends with its cause."""
    try:
        body = json.loads(detail)
        detail = str(body.get("error", body).get("message", detail))
    except (ValueError, AttributeError):
        pass
    detail = " ".join(ANSI.sub("", detail).split())
    return detail if len(detail) <= chars else "..." + detail[-chars:]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class Traffic:
    """The clients of one run against `base_url` from `start` until `deadline` (monotonic
    seconds; the times it records count from `start`)."""

    def __init__(self, base_url: str, params: ClientParams, limits: Limits, start: float,
                 deadline: float) -> None:
        self.url, self.p, self.limits = base_url.rstrip("/"), params, limits
        self.start, self.deadline = start, deadline
        self.tally = Tally()
        rng = random.Random(f"{params.seed}:docs")
        self.docs = [f"Document {i}. " + _words(rng, params.doc_words) for i in range(params.docs)]
        self.stopping = False

    def _now(self) -> float:
        return time.monotonic() - self.start

    def _open(self) -> bool:
        return (not self.stopping and time.monotonic() < self.deadline
                and self.tally.sent < self.p.max_requests)

    async def run(self, also: list | None = None) -> Tally:
        """Every client until the deadline, `also` (coroutines: the faults) beside them;
        then the requests in flight end (each bounded by its timeout)."""
        timeout = aiohttp.ClientTimeout(total=self.p.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout,
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            clients = [self._conversations(session, k) for k in range(self.p.conversations)]
            clients += [self._adversary(session), self._n16(session),
                        self._tenants(session)]
            try:
                await asyncio.gather(*clients, *(also or []))
            finally:
                self.stopping = True
        return self.tally

    # ---- well-formed greedy requests --------------------------------------------------------
    async def _conversations(self, session: aiohttp.ClientSession, k: int) -> None:
        rng = random.Random(f"{self.p.seed}:client:{k}")
        while self._open():
            messages = [{"role": "system", "content": rng.choice(self.docs)}]
            for _ in range(self.p.rounds):
                if not self._open():
                    return
                messages.append({"role": "user", "content": "Question: "
                                 + _words(rng, self.p.turn_words) + "?"})
                stream = rng.random() < 0.5
                answer = await self._greedy(session, messages, self.p.answer_tokens, stream,
                                            AnswerKind.STREAM if stream else AnswerKind.CHAT)
                if answer is None:  # counted; a new conversation starts, after a while
                    await self._pause(self.p.error_pause_s)
                    break
                messages.append({"role": "assistant", "content": answer})

    async def _n16(self, session: aiohttp.ClientSession) -> None:
        """Every `n16_every_s`: 16 greedy answers with 20 alternatives each, exactly the
        server's token limit long."""
        rng = random.Random(f"{self.p.seed}:n16")
        while self._open():
            await self._pause(self.p.n16_every_s)
            if not self._open():
                return
            messages = [{"role": "system", "content": rng.choice(self.docs)},
                        {"role": "user", "content": "Tell me everything: "
                         + _words(rng, self.p.turn_words)}]
            await self._greedy(session, messages, self.limits.max_new_tokens, rng.random() < 0.5,
                               AnswerKind.N16, n=16, top_logprobs=20, ignore_eos=True)

    async def _tenants(self, session: aiohttp.ClientSession) -> None:
        """Every `tenant_every_s`: tenant A (one `cache_salt`) asks about a document no one
        asked before, twice (its second a hit of its own), then tenant B (another salt) asks
        the same: B must be told 0 cached tokens, unless its answer moved instances."""
        rng = random.Random(f"{self.p.seed}:tenants")
        while self._open():
            await self._pause(self.p.tenant_every_s)
            if not self._open():
                return
            messages = [{"role": "system", "content": "Memo. " + _words(rng, self.p.doc_words)},
                        {"role": "user", "content": "What is the memo about?"}]
            usage: dict = {}
            for salt in ("chaos-tenant-a", "chaos-tenant-a", "chaos-tenant-b"):
                if await self._greedy(session, messages, 4, False, AnswerKind.CHAT,
                                      cache_salt=salt, usage=usage) is None:
                    break
            else:
                self.tally.tenant_probes += 1
                if usage.get("moves"):
                    self.tally.tenant_moved += 1
                else:
                    self.tally.tenant_shared_tokens += usage.get("cached_tokens", 0)

    async def _greedy(self, session: aiohttp.ClientSession, messages: list[dict],
                      max_tokens: int, stream: bool, kind: AnswerKind, n: int = 1,
                      top_logprobs: int = 0, ignore_eos: bool = False, cache_salt: str = "",
                      usage: dict | None = None) -> str | None:
        """One greedy chat request, recorded for judging; its first answer's text, or None
        when it failed (counted). `usage`, when given and the answer came whole, gets its
        cached prompt tokens and how many instances it left (`cached_tokens`, `moves`)."""
        body: dict[str, Any] = {"model": self.limits.model, "messages": messages,
                                "max_tokens": max_tokens, "temperature": 0, "logprobs": True,
                                "stream": stream}
        if cache_salt:
            body["cache_salt"] = cache_salt
        if n > 1:
            body["n"] = n
        if top_logprobs:
            body["top_logprobs"] = top_logprobs
        if ignore_eos:
            body["ignore_eos"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        at = self._now()
        self.tally.sent += 1
        try:
            texts, tokens = await (self._read_stream(session, body, n) if stream
                                   else self._read_whole(session, body, n, usage))
        except ServerError as exc:
            self.tally.error(True, exc.kind, exc.detail, at, self._now())
            return None
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.tally.error(True, type(exc).__name__, str(exc), at, self._now())
            return None
        except MALFORMED as exc:  # a 200 whose body is not an answer: the server's fault
            self.tally.error(True, "malformed_answer", f"{type(exc).__name__}: {exc}", at,
                             self._now())
            return None
        self.tally.answered += 1
        self.tally.answers.append(Answer(kind, tuple(dict(m) for m in messages), max_tokens,
                                         ignore_eos, tokens, at))
        return texts[0]

    async def _read_whole(self, session, body: dict, n: int,
                          usage: dict | None = None) -> tuple[list[str], tuple]:
        async with session.post(self.url + CHAT, json=body) as resp:
            await check_status(resp, ERROR_BYTES)
            raw = await resp.read()
        data = json.loads(raw)
        if usage is not None:
            usage["cached_tokens"] = int(
                ((data.get("usage") or {}).get("prompt_tokens_details") or {}).get(
                    "cached_tokens") or 0)
            usage["moves"] = int((data.get("kvtier") or {}).get("moves") or 0)
        choices = sorted(data["choices"], key=lambda c: c["index"])
        if len(choices) != n:
            raise ServerError("wrong_choices", f"{len(choices)} answers for n={n}")
        texts = [c["message"]["content"] or "" for c in choices]
        tokens = tuple(tuple(bytes(e["bytes"]) for e in (c.get("logprobs") or {}).get(
            "content") or []) for c in choices)
        return texts, tokens

    async def _read_stream(self, session, body: dict, n: int) -> tuple[list[str], tuple]:
        texts = [""] * n
        tokens: list[list[bytes]] = [[] for _ in range(n)]
        async with session.post(self.url + CHAT, json=body) as resp:
            await check_status(resp, ERROR_BYTES)
            async for chunk in sse_chunks(resp, ERROR_BYTES):
                for choice in chunk.get("choices") or []:
                    i = choice["index"]
                    texts[i] += (choice.get("delta") or {}).get("content") or ""
                    for e in (choice.get("logprobs") or {}).get("content") or []:
                        tokens[i].append(bytes(e["bytes"]))
        return texts, tuple(tuple(t) for t in tokens)

    # ---- the adversary ----------------------------------------------------------------------
    async def _adversary(self, session: aiohttp.ClientSession) -> None:
        rng = random.Random(f"{self.p.seed}:adversary")
        while self._open():
            if rng.random() < 0.3:
                await self._cancelled_stream(session, rng)
            else:
                await self._fuzz(session, rng)
            await self._pause(self.p.fuzz_pause_s)

    async def _fuzz(self, session: aiohttp.ClientSession, rng: random.Random) -> None:
        body = adversarial_body(rng, self.limits)
        at = self._now()
        self.tally.sent += 1
        try:
            async with session.post(self.url + body.path, data=body.data,
                                    headers={"Content-Type": "application/json"}) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.tally.error(False, type(exc).__name__, f"{body.data[:200]!r}: {exc}", at,
                             self._now())
            return
        self.tally.statuses[status] += 1
        if 400 <= status < 500:
            self.tally.refused_4xx += 1
        elif status == 200 and b'"server_error"' not in raw:
            self.tally.answered += 1
            self.tally.adversarial_answered += 1
        else:
            self.tally.error(False, f"adversarial_http_{status}",
                             f"{body.data[:200]!r} -> {raw[:ERROR_BYTES]!r}", at, self._now())

    async def _cancelled_stream(self, session: aiohttp.ClientSession,
                                rng: random.Random) -> None:
        """A streamed completion the client hangs up on after a chunk or three."""
        body = {"model": self.limits.model, "prompt": rng.choice(self.docs)[:400],
                "max_tokens": self.limits.max_new_tokens, "temperature": 0.7,
                "seed": rng.randrange(1 << 30), "stream": True}
        keep = rng.randrange(1, 4)
        at = self._now()
        self.tally.sent += 1
        try:
            async with session.post(self.url + COMPLETIONS, json=body) as resp:
                await check_status(resp, ERROR_BYTES)
                seen = 0
                async for _ in sse_chunks(resp, ERROR_BYTES):
                    seen += 1
                    if seen >= keep:
                        resp.close()  # hang up: the server must abort it and free its pages
                        self.tally.cancelled += 1
                        return
            self.tally.answered += 1  # it ended before the client could cut it
        except ServerError as exc:
            self.tally.error(True, exc.kind, exc.detail, at, self._now())
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self.tally.error(True, type(exc).__name__, str(exc), at, self._now())
        except MALFORMED as exc:
            self.tally.error(True, "malformed_answer", f"{type(exc).__name__}: {exc}", at,
                             self._now())

    async def _pause(self, seconds: float) -> None:
        end = min(time.monotonic() + seconds, self.deadline)
        while time.monotonic() < end and self._open():
            await asyncio.sleep(min(0.25, max(0.0, end - time.monotonic())))
