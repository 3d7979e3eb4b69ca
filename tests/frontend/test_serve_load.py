"""serve_load against a tiny in-test server that mimics the streaming chat completions API."""
from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from kvtier.bench.serve_load import (LoadParams, LoadResult, arrival_offsets, compare,
                                     parse_sse_line, percentile, run_load, run_load_sync,
                                     user_turn)

class FakeServer:
    """Streams role, content, finish, usage chunks and [DONE]. The cached tokens grow by
    round (counted from the assistant turns in the history): round r reuses r * 100 device
    tokens and r * 10 host tokens. `fail_every` answers 500 to every n-th request; `hang`
    never answers until the test ends."""

    def __init__(self, fail_every: int = 0, hang: bool = False, with_ext: bool = True,
                 models: bool = True, truncate: bool = False) -> None:
        self.fail_every, self.hang, self.with_ext = fail_every, hang, with_ext
        self.models, self.truncate = models, truncate
        self.bodies: list[dict] = []
        self.release = asyncio.Event()

    async def list_models(self, request: web.Request) -> web.Response:
        if not self.models:
            return web.json_response({"error": "no such route"}, status=404)
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if self.hang:
            await self.release.wait()
        if self.fail_every and len(self.bodies) % self.fail_every == 0:
            return web.json_response({"error": "boom"}, status=500)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in self.chunks(body):
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(0.001)
        if not self.truncate:
            await resp.write(b"data: [DONE]\n\n")
        return resp

    def chunks(self, body: dict) -> list[dict]:
        rounds = sum(m["role"] == "assistant" for m in body["messages"])
        delta = lambda d: {"choices": [{"index": 0, "delta": d, "finish_reason": None}]}
        out = [delta({"role": "assistant"})]
        out += [delta({"content": w}) for w in ("hello", " there", " friend")]
        out.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
        usage = {"choices": [], "usage": {"prompt_tokens": 200, "completion_tokens": 3,
                                          "prompt_tokens_details": {"cached_tokens": rounds * 110}}}
        if self.with_ext:
            usage["kvtier"] = {"cached_tokens": {"device": rounds * 100, "host": rounds * 10,
                                                 "storage": 0, "peer": 0}}
        return out + [usage]


async def serve(fake: FakeServer):
    app = web.Application()
    app.router.add_post("/v1/chat/completions", fake.chat)
    app.router.add_get("/v1/models", fake.list_models)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


async def load(fake: FakeServer, params: LoadParams) -> LoadResult:
    runner, base = await serve(fake)
    try:
        return await run_load(base, params)
    finally:
        fake.release.set()
        await runner.cleanup()


def params(**kw) -> LoadParams:
    base = dict(clients=3, rounds=3, turn_tokens=8, max_tokens=3, progress=False,
                timeout_s=10.0, request_timeout_s=5.0)
    return LoadParams(**(base | kw))


def test_all_rounds_answered_with_cached_tokens_by_tier():
    fake = FakeServer()
    res = asyncio.run(load(fake, params()))
    assert (res.requests, res.answered, res.errors, res.planned) == (9, 9, 0, 9)
    assert len(res.ttft_by_round_s) == 3
    assert all(t is not None and t > 0 for t in res.ttft_by_round_s)
    assert res.ttft_mean_s > 0 and res.ttft_p90_s >= res.ttft_mean_s * 0.5
    # per client: rounds 0, 1, 2 reuse 0, 100, 200 device and 0, 10, 20 host tokens
    assert res.cached_tokens == {"device": 3 * 300, "host": 3 * 30, "storage": 0, "peer": 0}
    assert res.cached_prompt_tokens == 3 * 330
    assert res.prompt_tokens == 9 * 200 and res.completion_tokens == 9 * 3
    assert res.requests_per_s > 0
    out = res.to_json()
    for key in ("requests", "answered", "ttft_mean_s", "ttft_p90_s", "requests_per_s",
                "cached_tokens", "ttft_by_round_s", "errors"):
        assert key in out
    json.dumps(out)


def test_requests_carry_the_growing_history():
    fake = FakeServer()
    asyncio.run(load(fake, params(clients=1)))
    assert [len(b["messages"]) for b in fake.bodies] == [1, 3, 5]
    last = fake.bodies[-1]
    assert last["model"] == "tiny"
    assert last["stream"] is True and last["stream_options"] == {"include_usage": True}
    assert last["messages"][1] == {"role": "assistant", "content": "hello there friend"}
    assert last["messages"][0]["content"] == user_turn(0, 0, 0, 8)


def test_model_falls_back_or_comes_from_params():
    fake = FakeServer(models=False)
    asyncio.run(load(fake, params(clients=1, rounds=1)))
    assert fake.bodies[0]["model"] == "default"
    fake = FakeServer()
    asyncio.run(load(fake, params(clients=1, rounds=1, model="mine", extra_body={"seed": 3})))
    assert fake.bodies[0]["model"] == "mine" and fake.bodies[0]["seed"] == 3


def test_missing_extension_is_tolerated():
    res = asyncio.run(load(FakeServer(with_ext=False), params(clients=2, rounds=2, progress=True)))
    assert res.answered == 4
    assert res.cached_tokens is None  # no `kvtier` extension: by tier unknown, not 0
    assert res.cached_prompt_tokens == 2 * 110


def test_server_errors_are_counted():
    res = asyncio.run(load(FakeServer(fail_every=2), params(clients=4, rounds=2)))
    assert res.errors > 0 and res.answered < res.requests
    assert res.answered + res.errors == res.requests
    assert res.error_kinds == {"http_500": res.errors}


def test_a_stream_without_done_is_an_error():
    res = asyncio.run(load(FakeServer(truncate=True), params(clients=2)))
    assert (res.requests, res.answered) == (2, 0)
    assert res.error_kinds == {"incomplete_stream": 2}


def test_a_hanging_server_is_bounded_by_the_request_timeout():
    t0 = time.monotonic()
    res = asyncio.run(load(FakeServer(hang=True), params(request_timeout_s=0.5)))
    assert time.monotonic() - t0 < 3
    assert (res.requests, res.answered, res.errors) == (3, 0, 3)
    assert res.error_kinds == {"timeout": 3}
    assert res.ttft_mean_s is None and res.ttft_by_round_s == [None, None, None]


def test_a_hanging_server_is_bounded_by_the_run_timeout():
    t0 = time.monotonic()
    res = asyncio.run(load(FakeServer(hang=True), params(timeout_s=0.5, request_timeout_s=30)))
    assert time.monotonic() - t0 < 3
    assert res.answered == 0 and res.errors == 3


def test_unreachable_server_fails_fast():
    res = run_load_sync("http://127.0.0.1:9", params(clients=2))
    assert res.answered == 0 and res.errors == 2


def test_poisson_arrivals():
    assert arrival_offsets(4, 0, 1) == [0.0] * 4
    assert arrival_offsets(4, float("inf"), 1) == [0.0] * 4
    offs = arrival_offsets(2000, 100.0, 1)
    assert offs == sorted(offs) and offs == arrival_offsets(2000, 100.0, 1)
    assert 15 < offs[-1] < 25  # 2000 arrivals at 100/s take about 20 s


def test_turns_are_deterministic_and_distinct():
    assert user_turn(0, 1, 0, 50) == user_turn(0, 1, 0, 50)
    assert user_turn(0, 1, 0, 50) != user_turn(0, 2, 0, 50)
    assert user_turn(1, 1, 1, 50) != user_turn(0, 1, 1, 50)
    assert len(user_turn(0, 1, 1, 50).split()) == 50


def test_sse_parsing_and_percentile():
    assert parse_sse_line(b"\n") is None and parse_sse_line(b": keepalive\n") is None
    assert parse_sse_line(b'data: {"a": 1}\n') == {"a": 1}
    assert percentile([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 90) == 9.1
    assert percentile([], 90) is None


def test_compare_reports_the_round2_ratio():
    fake = FakeServer()
    on = asyncio.run(load(fake, params(clients=1, rounds=2)))
    off = on.__class__(**(on.to_json() | {"ttft_by_round_s": [1.0, 2 * on.ttft_by_round_s[1]]}))
    out = compare(on, off)
    assert out["off"]["ttft_by_round_s"][1] == off.ttft_by_round_s[1]
    assert abs(out["round2_ttft_ratio"] - 0.5) < 1e-9
    assert compare(on, on.__class__(**(on.to_json() | {"ttft_by_round_s": [None, None]})))[
        "round2_ttft_ratio"] is None
