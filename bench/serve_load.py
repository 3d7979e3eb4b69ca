"""Multi-turn load against an OpenAI-compatible server: the reference's benchmark shape, scaled.

C clients each hold one conversation of R rounds. A round appends a user turn of about
`turn_tokens` synthetic words (the first one `first_turn_tokens`, when set: a document the
conversation is about) to the history and asks for `max_tokens` more, streamed; the
answer joins the history, so round r+1 resends everything of round r. That is what makes the
shape a cache benchmark: from round 2 on, most of the prompt is a prefix the server has seen
(in L1, or in L2/L3 once other conversations pushed it out). Clients start by Poisson arrivals
at `request_rate` per second and send their next round as soon as the previous answer is in.

Everything is bounded: each request by `request_timeout_s`, the whole run by `timeout_s`.
A failed round ends its conversation (its history would no longer be the one the server
cached); failures are counted, never retried, never waited on forever.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import Any, AsyncIterator, Callable, NamedTuple

import aiohttp
from tqdm import tqdm

log = logging.getLogger(__name__)

TIERS = ("device", "host", "storage", "peer")
WORDS = ("river", "lamp", "orange", "window", "garden", "signal", "paper", "copper", "winter",
         "market", "engine", "silver", "harbor", "canvas", "pillow", "forest", "ladder",
         "planet", "violet", "bridge", "cotton", "marble", "rocket", "velvet", "anchor",
         "meadow", "pepper", "castle", "thunder", "basket", "mirror", "falcon", "granite",
         "island", "jacket", "kettle", "lemon", "needle", "oyster", "pencil", "quartz",
         "saddle", "tunnel", "walnut", "yellow", "zipper", "candle", "dragon", "feather")
ERROR_BODY_BYTES = 512
FALLBACK_MODEL = "default"


class LoadParams(NamedTuple):
    clients: int = 8
    rounds: int = 3
    turn_tokens: int = 128  # words per user turn (about one token each)
    first_turn_tokens: int = 0  # words of the first turn (a document to talk about); 0: turn_tokens
    max_tokens: int = 16
    request_rate: float = 0.0  # client starts per second; 0 or inf: all at once
    seed: int = 0
    model: str | None = None  # None: the first id of GET /v1/models
    timeout_s: float = 600.0  # the whole run
    request_timeout_s: float = 120.0
    progress: bool = True  # tqdm bar on stderr
    extra_body: dict | None = None  # merged into every request body (e.g. ignore_eos)
    api_key: str | None = None  # sent as a bearer token


class RequestRecord(NamedTuple):
    """One round of one conversation, answered or not."""

    client: int
    round: int  # 0-based
    ok: bool
    ttft_s: float | None
    latency_s: float | None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens;
    # None: the server did not report it (vLLM without --enable-prompt-tokens-details)
    cached_by_tier: dict | None = None  # the `kvtier` usage extension, when the server sends it
    error: str = ""
    messages: tuple = ()  # what the request sent (answered requests; for --check-cold)
    text: str = ""  # the answer


class StreamResult(NamedTuple):
    """What one streamed answer carried."""

    text: str
    ttft_s: float
    latency_s: float
    usage: dict
    kvtier: dict


@dataclass(frozen=True)
class LoadResult:
    requests: int  # sent
    answered: int
    errors: int
    planned: int  # clients x rounds
    duration_s: float
    requests_per_s: float  # answered per second of the run
    ttft_mean_s: float | None
    ttft_p90_s: float | None
    latency_mean_s: float | None
    latency_p90_s: float | None
    ttft_by_round_s: list  # mean TTFT of answered requests per round (None: none answered)
    cached_tokens: dict | None  # by tier, from the `kvtier` usage extension (None: not sent)
    cached_prompt_tokens: int | None  # the standard usage figure, all tiers (None: not reported)
    prompt_tokens: int
    completion_tokens: int
    error_kinds: dict = field(default_factory=dict)
    # Every answered request reported usage.prompt_tokens_details.cached_tokens; when not,
    # the cached figures and hit rates are None (unknown), never 0.
    cached_tokens_reported: bool = False
    # Cached prompt tokens / prompt tokens over rounds 2 and later: the share of the resent
    # history the server reused instead of recomputing.
    hit_rate_after_round1: float | None = None
    model: str = ""  # what the requests named
    # (messages sent, answer text) of every answered request; not in the JSON
    exchanges: tuple = field(default=(), repr=False, compare=False)

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("exchanges")
        return out


# ---- workload ----------------------------------------------------------------------------
def user_turn(seed: int, client: int, round_: int, words: int) -> str:
    """Deterministic synthetic text, different for every (seed, client, round). The client
    id leads the first turn so no two conversations share a prefix by accident."""
    rng = random.Random(f"{seed}:{client}:{round_}")
    body = " ".join(rng.choice(WORDS) for _ in range(max(1, words)))
    head = f"Conversation {client}. " if round_ == 0 else ""
    return f"{head}{body}"


def arrival_offsets(clients: int, rate: float, seed: int) -> list[float]:
    """Client start times (s from the run start): a Poisson process at `rate` per second."""
    if rate <= 0 or math.isinf(rate):
        return [0.0] * clients
    rng = random.Random(f"arrivals:{seed}")
    t, out = 0.0, []
    for _ in range(clients):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def request_body(params: LoadParams, model: str, messages: list[dict]) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": params.max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    return body | (params.extra_body or {})


# ---- one streamed request ----------------------------------------------------------------
class ServerError(Exception):
    """A non-200 answer or an error inside the stream; `kind` is what the result counts."""

    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


DONE = object()  # the `data: [DONE]` line


def parse_sse_line(raw: bytes) -> dict | object | None:
    """A `data: {...}` line as a dict, `DONE` for `data: [DONE]`, None for blank lines,
    comments and other SSE fields."""
    line = raw.decode("utf-8", "replace").strip()
    if not line.startswith("data:"):
        return None
    payload = line[len("data:"):].strip()
    if payload == "[DONE]":
        return DONE
    chunk = json.loads(payload)
    if not isinstance(chunk, dict):
        raise ValueError(f"a stream chunk is not a JSON object: {payload[:80]}")
    return chunk


def chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta") or {}
    return delta.get("content") or ""


async def check_status(resp: aiohttp.ClientResponse, max_bytes: int = ERROR_BODY_BYTES) -> None:
    """ServerError `http_<status>` (with the body's first `max_bytes`) unless it is a 200."""
    if resp.status != 200:
        detail = (await resp.content.read(max_bytes)).decode("utf-8", "replace")
        raise ServerError(f"http_{resp.status}", detail)


async def sse_chunks(resp: aiohttp.ClientResponse,
                     max_error_bytes: int = ERROR_BODY_BYTES) -> AsyncIterator[dict]:
    """The JSON chunks of an event stream up to `data: [DONE]`. ServerError when a chunk is an
    error ("stream_error", its first `max_error_bytes`) or the server closes the stream before
    [DONE] ("incomplete_stream": the answer may be cut short)."""
    chunks = 0
    async for raw in resp.content:
        chunk = parse_sse_line(raw)
        if chunk is DONE:
            return
        if chunk is None:
            continue
        if chunk.get("error"):
            raise ServerError("stream_error", json.dumps(chunk["error"])[:max_error_bytes])
        chunks += 1
        yield chunk
    raise ServerError("incomplete_stream", f"{chunks} chunks, no [DONE]")


async def stream_chat(session: aiohttp.ClientSession, url: str, body: dict) -> StreamResult:
    """POST one streaming chat completion and read it to the end."""
    start = time.perf_counter()
    first: float | None = None
    parts, usage, ext = [], {}, {}
    async with session.post(url, json=body) as resp:
        await check_status(resp)
        async for chunk in sse_chunks(resp):
            text = chunk_text(chunk)
            if text and first is None:
                first = time.perf_counter() - start
            parts.append(text)
            usage = chunk.get("usage") or usage
            ext = chunk.get("kvtier") or ext
    latency = time.perf_counter() - start
    return StreamResult("".join(parts), latency if first is None else first, latency, usage, ext)


def answered_record(client: int, round_: int, res: StreamResult) -> RequestRecord:
    details = res.usage.get("prompt_tokens_details")
    cached = reported_int(details.get("cached_tokens")) if isinstance(details, dict) else None
    tiers = res.kvtier.get("cached_tokens")
    by_tier = {t: as_int(tiers.get(t)) for t in TIERS} if isinstance(tiers, dict) else None
    return RequestRecord(client, round_, True, res.ttft_s, res.latency_s,
                         as_int(res.usage.get("prompt_tokens")),
                         as_int(res.usage.get("completion_tokens")), cached, by_tier)


def as_int(value: object) -> int:
    """A usage figure as an int; a missing or odd one counts 0 rather than failing the run."""
    return reported_int(value) or 0


def reported_int(value: object) -> int | None:
    """A usage figure as an int; None when the server left it out (or sent no number)."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def failed_record(client: int, round_: int, kind: str) -> RequestRecord:
    return RequestRecord(client, round_, False, None, None, error=kind)


def error_kind(exc: BaseException) -> str:
    if isinstance(exc, ServerError):
        return exc.kind
    if isinstance(exc, asyncio.TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientError):  # connection refused, reset, ...
        return type(exc).__name__
    if isinstance(exc, ValueError):  # undecodable JSON, a chunk that is no object
        return "bad_stream"
    return type(exc).__name__


# ---- clients -----------------------------------------------------------------------------
class Conversation:
    """One client: waits for its start, then runs its rounds one after the other."""

    def __init__(self, client: int, params: LoadParams, url: str, model: str, start_s: float,
                 record: Callable[[RequestRecord], None]) -> None:
        self.client, self.params, self.url, self.model = client, params, url, model
        self.start_s, self.record = start_s, record
        self.messages: list[dict] = []

    async def run(self, session: aiohttp.ClientSession) -> None:
        await asyncio.sleep(self.start_s)
        for round_ in range(self.params.rounds):
            if not await self.round(session, round_):
                return

    async def round(self, session: aiohttp.ClientSession, round_: int) -> bool:
        p = self.params
        words = p.first_turn_tokens if round_ == 0 and p.first_turn_tokens else p.turn_tokens
        self.messages.append({"role": "user",
                              "content": user_turn(p.seed, self.client, round_, words)})
        body = request_body(p, self.model, self.messages)
        try:
            res = await asyncio.wait_for(stream_chat(session, self.url, body), p.request_timeout_s)
        except asyncio.CancelledError:  # the run's deadline: the request in flight failed
            self.record(failed_record(self.client, round_, "timeout"))
            raise
        except (aiohttp.ClientError, asyncio.TimeoutError, ServerError, ValueError) as exc:
            self.record(failed_record(self.client, round_, error_kind(exc)))
            return False
        sent = tuple(dict(m) for m in self.messages)
        self.messages.append({"role": "assistant", "content": res.text})
        self.record(answered_record(self.client, round_, res)._replace(messages=sent,
                                                                        text=res.text))
        return True


async def run_load(base_url: str, params: LoadParams) -> LoadResult:
    """Run the workload against `base_url` (e.g. http://127.0.0.1:8000) and summarize it."""
    base = base_url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=params.request_timeout_s)
    headers = {"Authorization": f"Bearer {params.api_key}"} if params.api_key else None
    async with aiohttp.ClientSession(timeout=timeout, headers=headers,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        model = params.model or await served_model(
            session, base, min(params.request_timeout_s, params.timeout_s))
        records, duration_s = await drive(session, base + "/v1/chat/completions", model, params)
    result = summarize(records, params.clients * params.rounds, params.rounds, duration_s)
    return replace(result, model=model)


async def drive(session: aiohttp.ClientSession, url: str, model: str,
                params: LoadParams) -> tuple[list[RequestRecord], float]:
    """All conversations, bounded by the run timeout; the records and the run's wall time."""
    records: list[RequestRecord] = []
    bar = tqdm(total=params.clients * params.rounds, desc="requests", unit="req",
               file=sys.stderr, disable=not params.progress)

    def record(r: RequestRecord) -> None:
        records.append(r)
        bar.update(1)

    offsets = arrival_offsets(params.clients, params.request_rate, params.seed)
    convs = [Conversation(i, params, url, model, offsets[i], record)
             for i in range(params.clients)]
    start = time.perf_counter()
    try:
        await run_bounded([c.run(session) for c in convs], params.timeout_s)
    finally:
        bar.close()
    return records, time.perf_counter() - start


async def served_model(session: aiohttp.ClientSession, base: str, timeout_s: float) -> str:
    """The first model the server lists. If it cannot say, the requests go out with
    "default" and their errors tell the story (the run itself must not fail here)."""
    try:
        return await asyncio.wait_for(first_model_id(session, base), timeout_s)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError, IndexError,
            KeyError, TypeError):
        log.warning("GET %s/v1/models gave no model id; sending model=%r", base, FALLBACK_MODEL)
        return FALLBACK_MODEL


async def first_model_id(session: aiohttp.ClientSession, base: str) -> str:
    async with session.get(base + "/v1/models") as resp:
        resp.raise_for_status()
        data = (await resp.json(content_type=None)).get("data") or []
        return str(data[0]["id"])


async def run_bounded(coros: list, timeout_s: float) -> None:
    """Run all coroutines; at the deadline cancel what is left and wait for it to unwind."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for t in pending:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def run_load_sync(base_url: str, params: LoadParams) -> LoadResult:
    """`run_load` for callers without an event loop (the CLI)."""
    return asyncio.run(run_load(base_url, params))


# ---- summary -----------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def summarize(records: list[RequestRecord], planned: int, rounds: int,
              duration_s: float) -> LoadResult:
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_s for r in ok]
    latencies = [r.latency_s for r in ok]
    by_round = [mean([r.ttft_s for r in ok if r.round == i]) for i in range(rounds)]
    by_tier = None
    if ok and all(r.cached_by_tier is not None for r in ok):
        by_tier = {t: sum(r.cached_by_tier.get(t, 0) for r in ok) for t in TIERS}
    reported = bool(ok) and all(r.cached_prompt_tokens is not None for r in ok)
    return LoadResult(
        requests=len(records), answered=len(ok), errors=len(records) - len(ok), planned=planned,
        duration_s=duration_s, requests_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        ttft_mean_s=mean(ttfts), ttft_p90_s=percentile(ttfts, 90),
        latency_mean_s=mean(latencies), latency_p90_s=percentile(latencies, 90),
        ttft_by_round_s=by_round, cached_tokens=by_tier,
        cached_prompt_tokens=sum(r.cached_prompt_tokens for r in ok) if reported else None,
        prompt_tokens=sum(r.prompt_tokens for r in ok),
        completion_tokens=sum(r.completion_tokens for r in ok),
        error_kinds=dict(Counter(r.error for r in records if not r.ok)),
        cached_tokens_reported=reported,
        hit_rate_after_round1=hit_rate([r for r in ok if r.round >= 1]) if reported else None,
        exchanges=tuple((r.messages, r.text) for r in ok))


def hit_rate(records: list[RequestRecord]) -> float | None:
    """Cached prompt tokens / prompt tokens of `records` (which all reported their cached
    tokens); None without prompt tokens to divide by."""
    prompt = sum(r.prompt_tokens for r in records)
    return sum(r.cached_prompt_tokens for r in records) / prompt if prompt else None


def compare(on: LoadResult, off: LoadResult) -> dict[str, Any]:
    """The cache-on run's JSON, the cache-off run's under "off", and the round-2 TTFT ratio:
    round 2 is the first to resend a whole earlier round, so it shows the reuse most plainly."""
    out = on.to_json()
    out["off"] = off.to_json()
    out["round2_ttft_ratio"] = round_ratio(on, off, 1)
    return out


def round_ratio(on: LoadResult, off: LoadResult, index: int) -> float | None:
    if len(on.ttft_by_round_s) <= index or len(off.ttft_by_round_s) <= index:
        return None
    a, b = on.ttft_by_round_s[index], off.ttft_by_round_s[index]
    return a / b if a is not None and b else None
