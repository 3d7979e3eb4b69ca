"""The chaos bench's clients against a small in-test server (no Ray): answers are read token
by token from their log-probabilities, whole or streamed, `n` 16 included; errors, streams
cut short and bodies that are no answer are counted as server errors with their cause;
adversarial bodies answered 4xx are refusals; a stream the client hangs up on is cancelled."""
from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from kvtier.bench.chaos_bodies import Limits
from kvtier.bench.chaos_clients import AnswerKind, ClientParams, Traffic

LIMITS = Limits("tiny", 49152, 1000, 8, 1 << 20)
TOKENS = [b"Hel", b"lo", b" \xe2\x82", b"\xac"]  # a character split over two tokens


def entry(raw: bytes) -> dict:
    return {"token": raw.decode("utf-8", "replace"), "logprob": -0.5, "bytes": list(raw),
            "top_logprobs": []}


class Fake:
    """Answers every greedy chat with TOKENS (per answer of `n`). `plan` says how the first
    chat requests of each shape ("whole", "stream") fail, in turn: "503", "stream_error" (an
    error chunk after a token), "cut" (no [DONE]) or "garbage" (a 200 that is not JSON); ""
    answers."""

    def __init__(self, plan: dict[str, list[str]] | None = None) -> None:
        self.plan = {k: list(v) for k, v in (plan or {}).items()}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        shape = "stream" if body.get("stream") else "whole"
        mode = self.plan[shape].pop(0) if self.plan.get(shape) else ""
        if mode == "503":
            return web.json_response({"error": {"message": "Traceback ... InstanceError: gone"}},
                                     status=503)
        n = body.get("n", 1)
        if shape == "whole":
            if mode == "garbage":
                return web.Response(text="not json", status=200)
            return web.json_response({"choices": [
                {"index": i, "message": {"content": "Hello €"},
                 "logprobs": {"content": [entry(t) for t in TOKENS]}} for i in range(n)]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for t in TOKENS:
            for i in range(n):
                await resp.write(b"data: " + json.dumps({"choices": [{
                    "index": i, "delta": {"content": "x"},
                    "logprobs": {"content": [entry(t)]}}]}).encode() + b"\n\n")
            if mode == "stream_error":
                await resp.write(b'data: {"error": {"message": "generation failed: boom"}}\n\n')
                await resp.write(b"data: [DONE]\n\n")
                return resp
        if mode != "cut":
            await resp.write(b"data: [DONE]\n\n")
        return resp

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({"error": {"message": "bad"}}, status=400)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(200):  # the client hangs up long before the end
            await resp.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
            await asyncio.sleep(0.01)
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def run_against(fake: Fake, seconds: float):
    app = web.Application(client_max_size=4 << 20)
    app.router.add_post("/v1/chat/completions", fake.chat)
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        start = time.monotonic()
        params = ClientParams(conversations=2, n16_every_s=0.3, fuzz_pause_s=0.02,
                              error_pause_s=0.05, request_timeout_s=10, seed=4)
        return await Traffic(base, params, LIMITS, start, start + seconds).run()
    finally:
        await runner.cleanup()


def test_answers_are_read_token_by_token_whole_and_streamed():
    tally = asyncio.run(run_against(Fake(), 1.5))
    kinds = {a.kind for a in tally.answers}
    assert kinds == {AnswerKind.CHAT, AnswerKind.STREAM, AnswerKind.N16}
    for answer in tally.answers:
        assert len(answer.choices) == (16 if answer.kind is AnswerKind.N16 else 1)
        assert all(choice == tuple(TOKENS) for choice in answer.choices)
    n16 = next(a for a in tally.answers if a.kind is AnswerKind.N16)
    assert n16.ignore_eos and n16.max_tokens == LIMITS.max_new_tokens
    assert tally.errors == []
    assert tally.refused_4xx > 0 and tally.cancelled > 0
    assert tally.sent == (tally.answered + tally.refused_4xx + tally.cancelled
                          + len(tally.errors))


def test_every_kind_of_failure_is_a_server_error_with_its_cause():
    plan = {"whole": ["", "503", "garbage"], "stream": ["", "stream_error", "cut", "503"]}
    tally = asyncio.run(run_against(Fake(plan), 2.0))
    kinds = sorted(e.kind for e in tally.errors)
    assert kinds == ["http_503", "http_503", "incomplete_stream", "malformed_answer",
                     "stream_error"], tally.errors
    assert all(e.well_formed for e in tally.errors)
    causes = {e.kind: e.cause for e in tally.errors}
    assert causes["http_503"] == "Traceback ... InstanceError: gone"
    assert causes["stream_error"] == "generation failed: boom"
    assert all(e.sent_s <= e.failed_s for e in tally.errors)
    assert tally.server_errors == 5 and tally.adversarial_server_errors == 0
    assert tally.answers  # before and after the failures
