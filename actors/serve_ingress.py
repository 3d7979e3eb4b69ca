"""The HTTP ingress of the serve graph: the OpenAI-compatible API, admin endpoints, metrics.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at
run time to know which parameter is the `Request`.)

Per request: parse and validate the body (`kvtier.frontend.openai_requests`), tokenize (chat
template for chat), ask the router which instance, stream token ids from that instance and
turn them into text (`TextStream`: incremental detokenizing, stop strings), and answer in
OpenAI's shapes with `usage.prompt_tokens_details.cached_tokens` and a `kvtier` field
(cached tokens by tier, the five lengths; in a prefill/decode graph, `pd`: its stages). A request without a seed gets one here, so that a
rank restart, which recomputes the request, reproduces the tokens already streamed, and so
does another instance when the router declares the first one stalled (`RoutedAnswer`).
"""

import asyncio
import logging
import random
import time
import uuid
from typing import Any, AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from kvtier.actors.l3.namespace_actor import purge_namespace
from kvtier.actors.pins import PinDesk
from kvtier.actors.ray_env import keep_serve_replica_on_loopback
from kvtier.actors.serve_answer import RoutedAnswer, RouterStates
from kvtier.actors.serve_replica import bound_attach_options
from kvtier.actors.serve_snapshots import SnapshotFeed
from kvtier.engine.sampling import TokenLogprob
from kvtier.errors import ConfigError, KvtierError
from kvtier.frontend import openai_responses as out
from kvtier.frontend import served_model
from kvtier.frontend.admin import check_admin_key, parse_admin_body
from kvtier.frontend.metrics import ServeMetrics
from kvtier.frontend.openai_logprobs import chat_logprobs, completion_logprobs
from kvtier.frontend.openai_requests import (ApiError, ApiLimits, ChatRequest, CompletionRequest,
                                             check_prompt_tokens, parse_chat, parse_completion)
from kvtier.frontend.pd_metrics import PDMetrics
from kvtier.frontend.pins import PinVerb
from kvtier.frontend.records import (NO_CACHED, AnswerFinal, AnswerItemKind, ReplicaConfig,
                                     ReplicaFlush, ReplicaStorage, Route, RouterStatus)
from kvtier.frontend.redispatch import InstanceUnavailable
from kvtier.frontend.request_failures import (AnswerFailed, answer_failed, generation_failed,
                                              timed_out, unavailable, unreadable)
from kvtier.frontend.settings import EngineKind, ServeSettings
from kvtier.frontend.tenants import ApiKeys, request_salt
from kvtier.frontend.text_stream import TextStream
from kvtier.tiers.cache_types import RequestLengths

log = logging.getLogger(__name__)

api = FastAPI(title="kvtier", docs_url=None, redoc_url=None, openapi_url=None)


class _Generation:
    """One answer's run on an instance (answer `index` of the request's `n`): where it runs,
    why the router chose that instance, its text, token count, log-probabilities (when
    asked) and final report."""

    def __init__(self, answer: RoutedAnswer, route: Route, stream: TextStream,
                 index: int = 0) -> None:
        self.answer, self.route, self.index = answer, route, index
        self.stream = stream
        self.tokens = 0
        self.final: AnswerFinal | None = None
        self.first_token_s: float | None = None
        self.finish_reason = "length"
        self.logprobs: list[TokenLogprob] = []  # one per answer token (when asked)
        self.text_offset = 0  # completions' logprobs: where the next token's text starts

    def logprobs_object(self, entries: Sequence[TokenLogprob], tokenizer: Any,
                        chat: bool) -> dict:
        """OpenAI's logprobs object for `entries` (the next ones of this answer)."""
        if chat:
            return chat_logprobs(entries, tokenizer)
        made = completion_logprobs(entries, tokenizer, self.text_offset)
        self.text_offset += sum(len(t) for t in made["tokens"])
        return made


def _storage_json(data: bytes) -> dict:
    """A replica's `ReplicaStorage` record as the admin endpoints show it."""
    return ReplicaStorage.from_msgpack(data).to_dict()


def _not_with_vllm(what: str) -> ApiError:
    return ApiError(400, f"{what} is not supported with engine vllm; serve with engine kvtier "
                         f"for it", code="not_supported_with_vllm")


def _error(err: ApiError) -> Response:
    """An error in OpenAI's shape, with its status."""
    return JSONResponse(err.to_body(), status_code=err.status)


def _refused(err: ApiError) -> Response:
    """A 401 (or another refusal of the caller) in OpenAI's error shape."""
    return JSONResponse(err.to_body(), status_code=err.status,
                        headers={"WWW-Authenticate": "Bearer"})


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  graceful_shutdown_wait_loop_s=0.2)
@serve.ingress(api)
class Ingress:
    def __init__(self, router: Any, instances: dict[str, Any], settings: dict) -> None:
        keep_serve_replica_on_loopback()
        self.router, self.instances = router, instances
        self.settings = ServeSettings.from_mapping(settings)
        s = self.settings
        self.tokenizer = served_model.tokenizer(s)
        self.api_keys = ApiKeys(s.api_keys, s.api_key)
        self.limits = ApiLimits(model_names=(s.served_model_name,),
                                max_prompt_tokens=s.max_prompt_tokens,
                                max_new_tokens=s.max_new_tokens, max_body_bytes=s.max_body_bytes)
        self.metrics = ServeMetrics()
        self.pd_metrics = (PDMetrics(self.metrics.registry, next(iter(instances)),
                                     s.pd_transport.value) if s.pd else None)
        self.created = int(time.time())
        self.snapshots = SnapshotFeed(router, instances, self.metrics, s.l3_actor)
        self._seeds = random.SystemRandom()
        self.check_s = s.stall_timeout_s / 4  # while an answer waits: is its instance stalled?
        self.timeout_s = s.request_timeout_s  # from arrival to the last answer's end
        self.states = RouterStates(router, max_age_s=self.check_s / 2)
        self.pins = PinDesk(router, instances, self.states, s, self.tokenizer, self.limits,
                            self.check_s)

    # ---- the OpenAI API -----------------------------------------------------------------------
    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        try:
            self._tenant(request)
        except ApiError as err:
            return _refused(err)
        return JSONResponse(out.models_response([self.settings.served_model_name],
                                                self.created))

    @api.get("/health")
    async def health(self) -> Response:
        status = RouterStatus.from_msgpack(await self.router.status.remote())
        broken = {i.name: i.broken for i in status.instances if i.broken}
        stalled = sorted(status.stalled())
        code = 503 if len(set(broken) | set(stalled)) == len(status.instances) else 200
        return JSONResponse({"status": "ok" if code == 200 else "unavailable",
                             "instances": len(status.instances), "broken": broken,
                             "stalled": stalled}, status_code=code)

    @api.get("/metrics")
    async def metrics(self) -> Response:
        self.snapshots.ensure_running()
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    # ---- admin (Authorization: Bearer <admin key>) --------------------------------------------
    @api.post("/admin/flush")
    async def admin_flush(self, request: Request) -> Response:
        return await self._admin(request, lambda h, _: h.flush.remote(),
                                 decode=lambda data: ReplicaFlush.from_msgpack(data).to_json())

    @api.get("/admin/config")
    async def admin_config(self, request: Request) -> Response:
        return await self._admin(request, lambda h, _: h.config.remote(), body=False,
                                 decode=lambda data: ReplicaConfig.from_msgpack(data).to_json())

    @api.get("/admin/storage")
    async def admin_storage(self, request: Request) -> Response:
        return await self._admin(request, lambda h, _: h.storage.remote(), body=False,
                                 decode=_storage_json)

    @api.post("/admin/storage/attach")
    async def admin_attach(self, request: Request) -> Response:
        """Body: {"backend": "file"|"mooncake"|"nixl", "options": {...}} (options optional)."""
        return await self._admin(request, lambda h, b: h.attach_l3.remote(
            b["backend"], bound_attach_options(self.settings, b)), needs=("backend",),
            decode=_storage_json)

    @api.post("/admin/storage/detach")
    async def admin_detach(self, request: Request) -> Response:
        return await self._admin(request, lambda h, _: h.detach_l3.remote(),
                                 decode=_storage_json)

    @api.post("/admin/purge")
    async def admin_purge(self, request: Request) -> Response:
        """Empty the deployment's L3 namespace on purpose (every page deleted from storage,
        the directory reset; the ranks back pages up again); answers the pages deleted."""
        if (denied := self._check_admin(request)) is not None:
            return denied
        if self.settings.engine is EngineKind.VLLM:
            return _error(_not_with_vllm("purging L3 through the admin API"))
        shown = [ReplicaStorage.from_msgpack(s) for s in await asyncio.gather(
            *(h.storage.remote() for h in self.instances.values()))]
        ns = next((s.l3.namespace for s in shown if s.l3), None)  # one for all
        if ns is None:
            err = ApiError(400, "no L3 is attached, so there is nothing to purge")
            return JSONResponse(err.to_body(), status_code=400)
        try:
            pages = await asyncio.get_running_loop().run_in_executor(
                None, purge_namespace, self.settings.l3_actor, ns)
        except Exception as exc:  # noqa: BLE001 - the actor is away: retry later
            return self._failed(exc)
        return JSONResponse({"namespace": ns, "purged_pages": pages})

    @api.get("/admin/router")
    async def admin_router(self, request: Request) -> Response:
        if (denied := self._check_admin(request)) is not None:
            return denied
        return JSONResponse(RouterStatus.from_msgpack(await self.router.status.remote()).to_json())

    @api.post("/admin/pin")
    async def admin_pin(self, request: Request) -> Response:
        """Body: tokens or messages, tenant and cache_salt (optional), ttl_s (actors/pins)."""
        return await self._pin(request, PinVerb.PIN)

    @api.delete("/admin/pin")
    async def admin_unpin(self, request: Request) -> Response:
        return await self._pin(request, PinVerb.UNPIN)

    @api.get("/admin/pin")
    async def admin_pins(self, request: Request) -> Response:
        return await self._pin(request, PinVerb.LIST)

    async def _pin(self, request: Request, verb: PinVerb) -> Response:
        if (denied := self._check_admin(request)) is not None:
            return denied
        if self.settings.pd:
            err = ApiError(400, "pinned prefixes are not supported with prefill/decode "
                                "disaggregation (--prefill-instances/--decode-instances); "
                                "serve with --instances to pin prefixes",
                           code="not_supported_with_pd")
            return JSONResponse(err.to_body(), status_code=400)
        if self.settings.engine is EngineKind.VLLM:
            return _error(_not_with_vllm("pinned prefixes"))
        try:
            status, body = await self.pins.handle(verb, await request.body())
        except Exception as exc:  # noqa: BLE001 - an instance or the L3 actor failed
            return self._failed(exc)
        return JSONResponse(body, status_code=status)

    # ---- request path ---------------------------------------------------------------------------
    async def _serve(self, request: Request, chat: bool) -> Response:
        rid = out.new_request_id(chat)  # in every server error of this request, and the log
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        try:
            tenant = self._tenant(request)
        except ApiError as err:
            return _refused(err)
        try:
            body = await request.body()
            req = parse_chat(body, self.limits) if chat else parse_completion(body, self.limits)
            tokens = self._tokens(req)
        except ApiError as exc:
            return _error(exc)
        except Exception:  # noqa: BLE001 - a bug, but the client still gets JSON
            log.exception("request %s could not be read", rid)
            return _error(unreadable(rid))
        seed = self._seeds.getrandbits(63)
        start = time.perf_counter()
        salt = request_salt(tenant, req.cache_salt)  # its prefixes are its tenant's only
        gens: list[_Generation] = []
        timer = asyncio.timeout_at(deadline)
        try:
            async with timer:
                for i in range(req.n):
                    gens.append(await self._start(req, tokens, seed, salt, i, rid))
        except Exception as exc:  # noqa: BLE001 - the router failed, or the time is up
            for gen in gens:
                gen.answer.cancel()
            return self._timed_out(rid, gens) if timer.expired() else self._failed(exc, rid)
        if req.stream:
            return StreamingResponse(self._sse(req, rid, chat, gens, tokens, start, deadline),
                                     media_type="text/event-stream")
        runs = [asyncio.ensure_future(self._drain(g, start)) for g in gens]
        timer = asyncio.timeout_at(deadline)
        try:
            async with timer:
                await asyncio.gather(*runs)
        except Exception as exc:  # noqa: BLE001 - the client gets an error saying what to do
            for run in runs:
                run.cancel()  # the other answers stop too (and free their instances)
            if timer.expired():
                return self._timed_out(rid, gens)
            return self._failed(exc, rid)
        for gen in gens:
            self._observe(gen, start, len(tokens))
        usage, kvtier = self._usage(len(tokens), gens)
        build = out.chat_response if chat else out.completion_response
        created = int(time.time())
        first, *more = (build(rid, req.model, created, g.stream.text, g.finish_reason, usage,
                              kvtier, index=g.index,
                              logprobs=None if req.logprobs is None else
                              g.logprobs_object(g.logprobs, self.tokenizer, chat))
                        for g in gens)
        return JSONResponse(out.with_choices(first, more) if more else first)

    async def _start(self, req: CompletionRequest | ChatRequest, tokens: list[int], seed: int,
                     salt: str, index: int, rid: str) -> _Generation:
        """Route answer `index` of request `rid`, as a request of its own, and start it:
        the instances know it as `rid` (one answer) or `rid/index`."""
        sampling = req.sampling(self.tokenizer.stop_token_ids, seed, index)
        route = Route.from_msgpack(await self.router.choose.remote(tokens, cache_salt=salt))
        answer = RoutedAnswer(self.router, self.instances, self.states, tokens, sampling,
                              route.instance, self.check_s, self.metrics.observe_redispatch,
                              cache_salt=salt,
                              request_id=rid if req.n == 1 else f"{rid}/{index}")
        return _Generation(answer, route, TextStream(self.tokenizer, req.stop), index)

    async def _drain(self, gen: _Generation, start: float) -> None:
        async for _ in self._run(gen, start):
            pass

    def _tokens(self, req: CompletionRequest | ChatRequest) -> list[int]:
        if isinstance(req, ChatRequest):
            messages = [{"role": m.role.value, "content": m.content} for m in req.messages]
            try:
                tokens = self.tokenizer.encode_chat(messages)
            except ConfigError as exc:  # the model's own template refused them
                raise ApiError(400, f"messages: {exc}", param="messages") from None
            param = "messages"
        elif req.is_token_prompt:
            tokens, param = list(req.prompt), "prompt"
        else:
            tokens, param = self.tokenizer.encode_prompt(req.prompt), "prompt"
        check_prompt_tokens(tokens, self.limits, self.tokenizer.vocab_size, param=param)
        return tokens

    async def _run(self, gen: _Generation, start: float) -> AsyncIterator[tuple[str, list]]:
        """Yield (text delta, the log-probabilities of its tokens when asked) until the
        instance finishes or a stop string is hit (then the instance's stream is cancelled,
        which aborts the request there)."""
        try:
            async for item in gen.answer.items():
                if item.kind is AnswerItemKind.ERROR:  # the instance ended this answer alone
                    raise AnswerFailed(item.error)
                if item.tokens and gen.first_token_s is None:
                    gen.first_token_s = time.perf_counter() - start
                gen.tokens += len(item.tokens)
                entries = item.logprobs or ()
                gen.logprobs += entries
                text, stopped = gen.stream.push(item.tokens)
                if item.final is not None:
                    gen.final, gen.finish_reason = item.final, item.final.finish_reason.value
                if text or entries:
                    yield text, entries
                if stopped:
                    gen.finish_reason = "stop"
                    return
            rest = gen.stream.finish()
            if rest:
                yield rest, []
        finally:
            if gen.final is None:
                gen.answer.cancel()

    async def _sse(self, req, rid: str, chat: bool, gens: list[_Generation],
                   tokens: list[int], start: float, deadline: float) -> AsyncIterator[str]:
        """The answers' chunks as they come (each with its index), then each one's closing
        chunk when it ends; usage and [DONE] once every answer has ended. A failed answer,
        or the request timeout (`deadline`, in the loop's time), ends the stream with an
        error event and [DONE]: the headers are sent, so the error is said in the stream."""
        created = int(time.time())

        def chunk(gen: _Generation, **kw) -> str:
            build = out.chat_chunk if chat else out.completion_chunk
            return out.sse(build(rid, req.model, created, include_usage=req.include_usage,
                                 index=gen.index, **kw))

        if chat:
            for gen in gens:
                yield chunk(gen, first=True)
        deltas: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.ensure_future(self._pump(g, start, deltas)) for g in gens]
        try:
            for _ in range(len(gens)):
                while True:
                    try:
                        async with asyncio.timeout_at(deadline):
                            gen, delta = await deltas.get()
                    except TimeoutError:
                        yield out.sse(self._timed_out_error(rid, gens).to_body())
                        yield out.SSE_DONE
                        return
                    if isinstance(delta, Exception):
                        yield out.sse(self._failure_error(rid, delta).to_body())
                        yield out.SSE_DONE
                        return
                    if delta is None:  # this answer ended
                        yield chunk(gen, finish_reason=gen.finish_reason)
                        break
                    text, entries = delta
                    logprobs = gen.logprobs_object(entries, self.tokenizer, chat) \
                        if req.logprobs is not None else None
                    yield (chunk(gen, content=text, logprobs=logprobs) if chat else
                           chunk(gen, text=text, logprobs=logprobs))
        finally:
            for pump in pumps:
                pump.cancel()  # a client gone, or a failed answer: the others stop too
        usage, kvtier = self._usage(len(tokens), gens)
        if req.include_usage:
            yield out.sse(out.usage_chunk(rid, req.model, created, usage, chat=chat,
                                          kvtier=kvtier))
        yield out.SSE_DONE
        for gen in gens:
            self._observe(gen, start, len(tokens))

    async def _pump(self, gen: _Generation, start: float, deltas: asyncio.Queue) -> None:
        """Put (gen, (text delta, logprobs)) on `deltas`, then (gen, None) at its end, or
        (gen, error)."""
        try:
            async for delta in self._run(gen, start):
                deltas.put_nowait((gen, delta))
            deltas.put_nowait((gen, None))
        except Exception as exc:  # noqa: BLE001 - reported in the stream by _sse
            deltas.put_nowait((gen, exc))

    def _usage(self, prompt_tokens: int, gens: list[_Generation]) -> tuple[dict, dict]:
        """OpenAI's usage (the prompt once, every answer's tokens) and the `kvtier` field
        (the first answer's: where its prompt came from, its route)."""
        gen = gens[0]
        final = gen.final
        cached = NO_CACHED if final is None else final.cached
        lengths = RequestLengths(0, 0, 0, 0, prompt_tokens) if final is None else final.lengths
        kvtier = out.kvtier_field(cached, lengths, None if final is None else final.pd)
        kvtier["instance"] = None if final is None else final.instance  # which served it
        kvtier["route"] = gen.route.to_field()
        kvtier["moves"] = gen.answer.moves  # instances it left (stalled or failed)
        answered = sum(g.tokens for g in gens)
        return out.usage(prompt_tokens, answered, cached, lengths), kvtier

    def _observe(self, gen: _Generation, start: float, prompt_tokens: int) -> None:
        self.snapshots.ensure_running()
        total = time.perf_counter() - start
        tpot = None
        if gen.first_token_s is not None and gen.tokens > 1:
            tpot = (total - gen.first_token_s) / (gen.tokens - 1)
        final = gen.final
        cached = NO_CACHED if final is None else final.cached
        queue = None if final is None else final.queue_s
        self.metrics.observe_request(gen.answer.instance, gen.first_token_s or total, tpot,
                                     cached, gen.finish_reason, prompt_tokens, gen.tokens, total,
                                     queue)
        if self.pd_metrics is not None and final is not None and final.pd is not None:
            self.pd_metrics.observe(gen.answer.instance, final.pd)

    # ---- failures: the client learns what to do and the request id; the log, the details ------
    def _failure_error(self, rid: str, exc: Exception) -> ApiError:
        """The error to send for `exc` (logged here, with its traceback when unexpected)."""
        if isinstance(exc, AnswerFailed):
            log.warning("request %s: an instance ended an answer: %s", rid, exc.message)
            return answer_failed(rid, exc)
        if isinstance(exc, InstanceUnavailable):  # foreseen (stalls, stops): no traceback
            log.warning("request %s: %s", rid, exc)
            return unavailable(rid)
        log.error("request %s failed", rid, exc_info=exc)
        return generation_failed(rid)

    def _failed(self, exc: Exception, rid: str | None = None) -> Response:
        return _error(self._failure_error(rid or f"admin-{uuid.uuid4().hex}", exc))

    def _timed_out_error(self, rid: str, gens: list[_Generation]) -> ApiError:
        log.warning("request %s: stopped at its request timeout of %g s (%d of its %d "
                    "answers ended, %d tokens answered)", rid, self.timeout_s,
                    sum(g.final is not None for g in gens), len(gens),
                    sum(g.tokens for g in gens))
        return timed_out(rid, self.timeout_s)

    def _timed_out(self, rid: str, gens: list[_Generation]) -> Response:
        return _error(self._timed_out_error(rid, gens))

    # ---- admin helpers --------------------------------------------------------------------------
    def _tenant(self, request: Request) -> str:
        """The caller's tenant by its API key ("" when the OpenAI endpoints are open); a 401
        ApiError when the key is missing or unknown."""
        return self.api_keys.tenant(request.headers.get("authorization", ""))

    def _check_admin(self, request: Request) -> Response | None:
        try:
            check_admin_key(request.headers.get("authorization", ""), self.settings.admin_key)
        except ApiError as err:
            return _refused(err)
        return None

    async def _admin(self, request: Request, call, body: bool = True,
                     needs: tuple[str, ...] = (), decode=lambda result: result) -> Response:
        """`call(handle, body)` on every instance; their results (each through `decode`:
        a record's JSON) as {"instances": [...]}."""
        if (denied := self._check_admin(request)) is not None:
            return denied
        args: dict = {}
        if body:
            try:
                args = parse_admin_body(await request.body())
                for name in needs:
                    if name not in args:
                        raise ApiError(400, f"{name}: required", param=name)
            except ApiError as exc:
                return _error(exc)
        try:
            results = await asyncio.gather(*(call(h, args) for h in self.instances.values()))
        except Exception as exc:  # noqa: BLE001 - a RayTaskError wraps the instance's error
            # (and is an instance of its class too, but its text is the remote traceback)
            cause = getattr(exc, "cause", None) or exc
            if isinstance(cause, (ConfigError, KvtierError, ValueError)):
                return _error(ApiError(400, str(cause)))
            return self._failed(exc)
        return JSONResponse({"instances": [decode(r) for r in results]})
