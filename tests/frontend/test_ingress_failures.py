"""What a client gets when a request fails on the server's side, without Ray: the ingress's
request path (`_serve`, `_run`, `_pump`, `_sse`) driven by fake answers.

- An instance that ends one answer with an ERROR `AnswerItem` (sampling or
  stopping that answer failed): a 500 (streamed: an error event, then [DONE]) with that
  message, the request id and what to do; the request's other answers stop, and nothing
  more is read from the failed one.
- An unexpected failure (a Ray error carrying the remote traceback): a 503 saying what to
  do, with the request id and no exception text; the log has both.
- The request timeout: past it, every answer is cancelled and the client gets a 504.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random

import pytest
from ray.exceptions import RayTaskError

from kvtier.actors.serve_ingress import Ingress, _Generation
from kvtier.engine.request import FinishReason
from kvtier.errors import ConfigError
from kvtier.frontend.metrics import ServeMetrics
from kvtier.frontend.openai_requests import ApiLimits
from kvtier.frontend.records import (NO_CACHED, AnswerFinal, AnswerItem, AnswerItemKind,
                                     ExpectedPages, Route)
from kvtier.frontend.redispatch import InstanceUnavailable
from kvtier.frontend.router_index import ChoiceReason
from kvtier.frontend.settings import ServeSettings
from kvtier.frontend.tenants import ApiKeys
from kvtier.frontend.text_stream import TextStream
from kvtier.tiers.cache_types import RequestLengths

MODEL = "m"
SECRET = "/srv/secret/engine.py"  # what a remote traceback shows: never to the client
TRACEBACK = (f'Traceback (most recent call last):\n  File "{SECRET}", line 7, in step\n'
             f"    probs = torch.softmax(logits)\nRuntimeError: probability tensor contains "
             f"either inf, nan or element < 0")
FAILED = "sampling this answer failed: its probabilities are not finite"
HANG_GUARD_S = 10  # a request that never ends fails the test, not the run
FINAL = AnswerFinal(FinishReason.LENGTH, NO_CACHED, RequestLengths(0, 0, 0, 0, 3), None, None,
                    "instance-0")


def more(tokens: list[int]) -> AnswerItem:
    return AnswerItem.more(tokens)


def failed_item(tokens: list[int]) -> AnswerItem:
    return AnswerItem(AnswerItemKind.ERROR, tokens, error=FAILED)


def final_item(tokens: list[int]) -> AnswerItem:
    return AnswerItem(AnswerItemKind.FINAL, tokens, final=FINAL)


class Tokenizer:
    vocab_size = 100
    stop_token_ids = ()

    @staticmethod
    def decode(ids) -> str:
        return "".join(f"<{i}>" for i in ids)


class Answer:
    """A RoutedAnswer's two calls: `items()` gives `script` (an exception in it is raised),
    then waits forever when `hang`; `cancel()` is recorded."""

    def __init__(self, *script, hang: bool = False) -> None:
        self.script, self.hang = script, hang
        self.instance = "instance-0"
        self.moves = 0
        self.cancelled = False
        self.read_after_error = False

    async def items(self):
        failed = False
        for item in self.script:
            self.read_after_error = failed
            if isinstance(item, BaseException):
                raise item
            failed = item.kind is AnswerItemKind.ERROR
            yield item
        self.read_after_error = failed
        if self.hang:
            await asyncio.Event().wait()

    def cancel(self) -> None:
        self.cancelled = True


class Snapshots:
    def ensure_running(self) -> None:
        pass


class Request:
    def __init__(self, body: dict) -> None:
        self.headers: dict = {}
        self._body = json.dumps(body).encode()

    async def body(self) -> bytes:
        return self._body


# The class as written (Serve's deployment wraps it in an ASGI class of its own)
INGRESS = next(c for c in Ingress.func_or_class.__mro__ if "_serve" in c.__dict__)


def ingress(answers: list[Answer], timeout_s: float = 300.0):
    """An Ingress without Serve: its state set by hand, `_start` handing out `answers`."""
    ing = object.__new__(INGRESS)
    ing.tokenizer, ing.timeout_s = Tokenizer(), timeout_s
    ing.limits = ApiLimits(model_names=(MODEL,), max_prompt_tokens=64, max_new_tokens=16)
    ing.api_keys, ing._seeds = ApiKeys(), random.Random(0)
    ing.metrics, ing.snapshots, ing.pd_metrics = ServeMetrics(), Snapshots(), None

    async def start(req, tokens, seed, salt, index, rid):
        route = Route("instance-0", ChoiceReason.TIE, ExpectedPages(0, 0, 0))
        return _Generation(answers[index], route, TextStream(ing.tokenizer, req.stop), index)

    ing._start = start
    return ing


def serve(ing, stream: bool = False, n: int = 1, chat: bool = False) -> tuple[int, object]:
    """(status, the JSON body) or, streamed, (200, the events' data: dicts and "[DONE]")."""
    body = {"model": MODEL, "max_tokens": 8, "n": n, "stream": stream}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat
                else {"prompt": [1, 2, 3]})

    async def go():
        if chat:  # the chat template needs a real tokenizer: its tokens are not the point
            ing._tokens = lambda req: [1, 2, 3]
        response = await ing._serve(Request(body), chat=chat)
        if not stream or response.status_code != 200 or \
                not response.media_type.startswith("text/event-stream"):
            got = response.status_code, json.loads(response.body)
        else:
            text = "".join([chunk async for chunk in response.body_iterator])
            events = [e[len("data: "):] for e in text.split("\n\n") if e]
            got = 200, [e if e == "[DONE]" else json.loads(e) for e in events]
        for _ in range(3):
            await asyncio.sleep(0)  # cancelled runs reach their `finally`
        return got

    return asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))


def server_error(error: dict, status: int) -> str:
    """The error's message, checked: a server error, no traceback or exception text."""
    assert error["type"] == "server_error", error
    message = error["message"]
    assert "Traceback" not in message and SECRET not in message and "RuntimeError" not in message
    return message


# ---- an instance ends one answer ------------------------------------------------------------

@pytest.mark.parametrize("chat", [False, True])
def test_an_answer_the_instance_ended_is_a_500_and_stops_the_others(chat):
    failing = Answer(more([5, 6]), failed_item([7]), more([8]))
    other = Answer(more([9]), hang=True)
    status, body = serve(ingress([other, failing]), n=2, chat=chat)
    assert status == 500
    message = server_error(body["error"], 500)
    assert FAILED in message and "other sampling settings" in message
    rid = message.split("request id ")[1].split(")")[0]
    assert rid.startswith("chatcmpl-" if chat else "cmpl-")
    assert other.cancelled  # the other answer stopped, its instance freed
    assert not failing.read_after_error  # the error was its last item: no wait for more


def test_a_streamed_answer_the_instance_ended_is_an_error_event_then_done():
    failing = Answer(more([5]), failed_item([]))
    other = Answer(more([9]), hang=True)
    status, events = serve(ingress([failing, other]), stream=True, n=2)
    assert status == 200 and events[-1] == "[DONE]" and events.count("[DONE]") == 1
    (error,) = [e["error"] for e in events[:-1] if "error" in e]
    assert "error" in events[-2]  # nothing after the error but [DONE]
    message = server_error(error, 500)
    assert FAILED in message and "request id cmpl-" in message
    assert other.cancelled and not failing.read_after_error


def test_an_error_item_is_no_final_item():
    """A request whose answers all end well is answered; the same with an error item is not
    (whatever tokens came before it)."""
    ok = Answer(more([5]), final_item([6]))
    status, body = serve(ingress([ok]))
    assert status == 200 and body["choices"][0]["text"] == "<5><6>"
    bad = Answer(more([5]), failed_item([6]))
    assert serve(ingress([bad]))[0] == 500


# ---- unexpected failures --------------------------------------------------------------------

def remote_failure() -> RayTaskError:
    return RayTaskError("generate", TRACEBACK, RuntimeError(TRACEBACK)).as_instanceof_cause()


@pytest.mark.parametrize("stream", [False, True])
def test_a_remote_failure_gives_no_traceback_and_the_log_has_it(stream, caplog):
    answer = Answer(more([5]), remote_failure())
    with caplog.at_level(logging.ERROR, logger="kvtier.actors.serve_ingress"):
        status, got = serve(ingress([answer]), stream=stream)
    error = got[-2]["error"] if stream else got["error"]
    assert status == (200 if stream else 503)
    message = server_error(error, 503)
    assert "retry" in message
    rid = message.split("request id ")[1].split(")")[0]
    logged = "\n".join(r.getMessage() + (str(r.exc_info[1]) if r.exc_info else "")
                       for r in caplog.records)
    assert rid in logged and SECRET in logged  # the operator finds the details by the id


@pytest.mark.parametrize("stream", [False, True])
def test_no_live_instance_is_a_503_saying_retry_shortly(stream):
    answer = Answer(more([5]), InstanceUnavailable(
        "instance instance-0 stalled and no other instance is live"))
    status, got = serve(ingress([answer]), stream=stream)
    error = got[-2]["error"] if stream else got["error"]
    assert status == (200 if stream else 503) and error["code"] == "no_instance_available"
    message = server_error(error, 503)
    assert "retry shortly" in message and "request id cmpl-" in message


def test_a_bug_while_reading_the_request_is_a_500_without_its_text(caplog):
    ing = ingress([])

    def broken(req):
        raise KeyError(SECRET)

    ing._tokens = broken
    with caplog.at_level(logging.ERROR, logger="kvtier.actors.serve_ingress"):
        status, body = asyncio.run(asyncio.wait_for(_plain(ing), HANG_GUARD_S))
    assert status == 500
    message = server_error(body["error"], 500)
    rid = message.split("request id ")[1].split(")")[0]
    assert any(rid in r.getMessage() and r.exc_info for r in caplog.records)


async def _plain(ing) -> tuple[int, dict]:
    response = await ing._serve(Request({"model": MODEL, "prompt": [1]}), chat=False)
    return response.status_code, json.loads(response.body)


def test_an_admin_call_that_fails_remotely_shows_its_message_not_its_traceback():
    ing = ingress([])
    ing.settings = ServeSettings(model="tiny", admin_key="k" * 16)
    ing.instances = {"instance-0": object()}

    async def refuse(handle, args):
        cause = ConfigError("L3 is attached already (file); detach it first")
        raise RayTaskError("attach_l3", TRACEBACK, cause).as_instanceof_cause()

    async def go():
        request = Request({"backend": "file"})
        request.headers = {"authorization": "Bearer " + "k" * 16}
        return await ing._admin(request, refuse)

    response = asyncio.run(asyncio.wait_for(go(), HANG_GUARD_S))
    error = json.loads(response.body)["error"]
    assert response.status_code == 400 and "detach it first" in error["message"]
    assert "Traceback" not in error["message"] and SECRET not in error["message"]


# ---- the request timeout --------------------------------------------------------------------

def test_past_the_request_timeout_the_answers_stop_and_the_client_gets_a_504():
    answers = [Answer(more([5]), hang=True), Answer(final_item([6]))]
    status, body = serve(ingress(answers, timeout_s=0.05), n=2)
    assert status == 504
    message = server_error(body["error"], 504)
    assert "0.05 s" in message and "max_tokens" in message and "request_timeout_s" in message
    assert "request id cmpl-" in message and body["error"]["code"] == "timeout"
    assert answers[0].cancelled  # the instance frees it


def test_a_streamed_request_past_its_timeout_ends_with_an_error_event_then_done():
    answer = Answer(more([5]), hang=True)
    status, events = serve(ingress([answer], timeout_s=0.05), stream=True)
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0]["choices"][0]["text"] == "<5>"  # what came in time was sent
    message = server_error(events[-2]["error"], 504)
    assert "0.05 s" in message and "request id cmpl-" in message
    assert answer.cancelled
