"""The stall deadline without Ray: the router's liveness, the skipped prefix of a re-dispatched
answer, and the ingress's `RoutedAnswer` driven by fake handles."""
from __future__ import annotations

import argparse
import asyncio

import pytest

from kvtier.actors.serve_answer import RoutedAnswer, RouterStates
from kvtier.actors.step_wire import decode_resume, decode_sampling
from kvtier.engine.request import FinishReason, Resume
from kvtier.engine.sampling import SamplingParams, TokenLogprob
from kvtier.errors import ConfigError
from kvtier.frontend.liveness import InstanceState, Liveness, candidates
from kvtier.frontend.metrics import ServeMetrics
from kvtier.frontend.records import (NO_CACHED, AnswerFinal, AnswerItem, AnswerItemKind,
                                     InstanceStates, NamedState, Route)
from kvtier.frontend.redispatch import InstanceUnavailable, SentTokens
from kvtier.frontend.settings import ServeSettings
from kvtier.cli.serve_command import add_arguments, settings_from
from kvtier.tiers.cache_types import RequestLengths

LIVE, STALLED = InstanceState.LIVE, InstanceState.STALLED


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_busy_instance_without_a_step_stalls_and_comes_back_when_it_steps():
    clock = Clock()
    live = Liveness(["a", "b"], stall_timeout_s=2.0, clock=clock)
    assert live.answered("a", steps=5, busy=True) is LIVE
    clock.now += 1.9
    assert live.answered("a", steps=5, busy=True) is LIVE  # answering, but not stepping
    clock.now += 0.2
    assert live.answered("b", steps=0, busy=False) is LIVE
    assert live.answered("a", steps=5, busy=True) is STALLED
    assert live.view("a").stalls == 1 and live.view("a").quiet_s == pytest.approx(2.1)
    assert live.live() == {"b"}
    assert live.answered("a", steps=6, busy=True) is LIVE  # it stepped again
    assert live.view("a").stalls == 1 and live.live() == {"a", "b"}


def test_idle_instance_is_live_however_long_ago_it_stepped():
    clock = Clock()
    live = Liveness(["a"], stall_timeout_s=2.0, clock=clock)
    for _ in range(5):
        clock.now += 10
        assert live.answered("a", steps=1, busy=False) is LIVE
    clock.now += 0.5  # work arrives after a long idle time: the deadline starts now
    assert live.answered("a", steps=1, busy=True) is LIVE


def test_unanswered_polls_stall_an_instance_an_answer_brings_it_back():
    clock = Clock()
    live = Liveness(["a"], stall_timeout_s=2.0, clock=clock)
    live.answered("a", steps=3, busy=False)
    clock.now += 1.0
    assert live.unanswered("a") is LIVE
    clock.now += 1.0
    assert live.unanswered("a") is STALLED
    clock.now += 3.0
    assert live.state("a") is STALLED and live.view("a").stalls == 1  # counted once
    assert live.answered("a", steps=3, busy=False) is LIVE  # idle and answering again
    clock.now += 2.0
    assert live.state("a") is STALLED and live.view("a").stalls == 2


def test_candidates_leave_out_broken_stalled_and_avoided():
    assert candidates({"a": 1, "b": 0, "c": 2}, {"b", "x"}) == {"a": 1, "c": 2}
    assert candidates({"a": 1}, {"a"}) == {}


def test_sent_tokens_are_what_another_instance_goes_on_after():
    sent = SentTokens()
    assert sent.resume(with_logprobs=True) is None  # nothing sent: from the prompt
    lps = [TokenLogprob(1, -0.5, ()), TokenLogprob(2, -0.25, ((2, -0.25),))]
    sent.add([1, 2], lps)
    sent.add([3])
    assert sent.ids == [1, 2, 3]
    assert sent.resume(with_logprobs=False) == Resume((1, 2, 3), None)
    assert sent.resume(with_logprobs=True) == Resume((1, 2, 3), tuple(lps))


def test_stall_timeout_is_validated():
    assert ServeSettings().stall_timeout_s == 2.0
    assert ServeSettings.from_mapping({"stall_timeout_s": 5}).stall_timeout_s == 5
    for bad in (0, -1, float("nan"), "2", True):
        with pytest.raises(ConfigError, match="stall_timeout_s"):
            ServeSettings(stall_timeout_s=bad)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from(parser.parse_args([])).stall_timeout_s == 2.0
    assert settings_from(parser.parse_args(["--stall-timeout-s", "5"])).stall_timeout_s == 5.0


def test_stall_metrics_render():
    m = ServeMetrics()
    m.update_liveness("instance-0", stalls=0, stalled=False)
    m.update_liveness("instance-0", stalls=2, stalled=True)
    m.update_liveness("instance-0", stalls=2, stalled=True)
    m.observe_redispatch("instance-0")
    body = m.render()[0].decode()
    assert 'kvtier_instance_stalls_total{kvtier_instance="instance-0"} 2.0' in body
    assert 'kvtier_instance_stalled{kvtier_instance="instance-0"} 1.0' in body
    assert 'kvtier_redispatched_requests_total{kvtier_instance="instance-0"} 1.0' in body


# ---- RoutedAnswer with fake handles ---------------------------------------------------------
ANSWER = [10, 11, 12, 13, 14, 15]
FINAL = AnswerFinal(FinishReason.LENGTH, NO_CACHED, RequestLengths(0, 0, 0, 0, 3), None, None,
                    "?")


class FakeStream:
    """An instance's answer going on after `have` tokens: the tokens of `items` past them
    (each item a list of tokens; the last one final), then, if `hang`, nothing more until
    cancelled; `fail`: raises instead of ending (the instance stopped)."""

    def __init__(self, items: list[list[int]], hang: bool, have: int = 0,
                 fail: bool = False, error: bool = False) -> None:
        self.items, self.hang, self.cancelled, self.fail = [], hang, False, fail
        self.error = error  # the last item says the request failed by itself
        self.delay_s = 0.001  # before each item
        at = 0
        for item in items:
            self.items.append(item[max(0, have - at):])
            at += len(item)

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        if not self.items:
            if self.hang:
                await asyncio.sleep(3600)
            if self.fail:
                raise RuntimeError("instance a stopped serving: remote traceback ...")
            raise StopAsyncIteration
        tokens = self.items.pop(0)
        await asyncio.sleep(self.delay_s)
        if self.items or self.hang or self.fail:
            return AnswerItem.more(tokens).to_msgpack()
        if self.error:
            return AnswerItem(AnswerItemKind.ERROR, tokens,
                              error="choosing its next token failed").to_msgpack()
        return AnswerItem(AnswerItemKind.FINAL, tokens, final=FINAL).to_msgpack()

    def cancel(self) -> None:
        self.cancelled = True


class FakeInstance:
    def __init__(self, items: list[list[int]], hang: bool = False, fail: bool = False,
                 error: bool = False) -> None:
        self.items, self.hang, self.fail, self.streams, self.salts = items, hang, fail, [], []
        self.error = error
        self.delay_s = 0.001
        self.resumes: list = []
        self.request_ids: list[str] = []

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return self

    def remote(self, tokens, sampling, cache_salt="", resume=None,
               request_id="") -> FakeStream:
        self.salts.append(cache_salt)
        self.request_ids.append(request_id)
        resume = decode_resume(resume)  # the wire form the replica takes
        decode_sampling(sampling)
        self.resumes.append(None if resume is None else [list(resume.tokens), resume.logprobs])
        have = 0 if resume is None else len(resume.tokens)
        self.streams.append(FakeStream(self.items, self.hang, have, self.fail, self.error))
        self.streams[-1].delay_s = self.delay_s
        return self.streams[-1]


class FakeRouter:
    """Says `stalled` is stalled (or `state`) once asked `stall_after` times; choose gives
    `other`."""

    def __init__(self, stalled: str, other: str | None, stall_after: int = 2,
                 state: str = "stalled") -> None:
        self.stalled, self.other, self.stall_after = stalled, other, stall_after
        self.state = state
        self.asked, self.avoided, self.salts = 0, [], []
        self.states, self.choose = self._Call(self._states), self._Call(self._choose)

    class _Call:
        def __init__(self, fn) -> None:
            self.fn = fn

        async def remote(self, *args, **kw):
            return self.fn(*args, **kw)

    def _states(self) -> bytes:
        self.asked += 1
        state = self.state if self.asked > self.stall_after else "live"
        return InstanceStates((NamedState(self.stalled, InstanceState(state)),)).to_msgpack()

    def _choose(self, tokens, avoid=(), cache_salt="") -> bytes:
        self.avoided.append(tuple(avoid))
        self.salts.append(cache_salt)
        return Route(self.other).to_msgpack()


def run_answer(instances: dict, router: FakeRouter) -> tuple[list[int], RoutedAnswer]:
    moved: list[str] = []

    async def go() -> tuple[list[int], RoutedAnswer]:
        answer = RoutedAnswer(router, instances, RouterStates(router, max_age_s=0.0),
                              [1, 2, 3], SamplingParams(), "a", check_s=0.01,
                              on_move=moved.append, cache_salt="salt-1",
                              request_id="chatcmpl-1")
        got = []
        async for item in answer.items():
            got.extend(item.tokens)
        return got, answer

    got, answer = asyncio.run(asyncio.wait_for(go(), 10))
    assert moved == ["a"] * answer.sent.moves
    return got, answer


def test_a_stalled_answer_moves_and_goes_on_after_what_the_client_has():
    a = FakeInstance([ANSWER[:2], ANSWER[2:3]], hang=True)  # three tokens, then nothing
    b = FakeInstance([ANSWER[:4], ANSWER[4:]])
    got, answer = run_answer({"a": a, "b": b}, FakeRouter("a", "b"))
    assert got == ANSWER and answer.instance == "b" and answer.sent.moves == 1
    assert a.resumes == [None] and b.resumes == [[ANSWER[:3], None]]  # b goes on after 3
    assert a.streams[0].cancelled and not b.streams[0].cancelled  # a's late answer: dropped
    assert a.salts == b.salts == ["salt-1"]  # the request keeps its tenant where it moves
    assert a.request_ids == b.request_ids == ["chatcmpl-1"]  # and its id


def test_a_failed_stream_moves_at_once():
    a = FakeInstance([ANSWER[:2]], fail=True)  # two tokens, then the instance stops
    b = FakeInstance([ANSWER])
    router = FakeRouter("a", "b", stall_after=10**6)  # never says stalled
    got, answer = run_answer({"a": a, "b": b}, router)
    assert got == ANSWER and b.resumes == [[ANSWER[:2], None]]


def test_a_failed_stream_with_nowhere_to_go_is_unavailable():
    a = FakeInstance([ANSWER[:2]], fail=True)
    with pytest.raises(InstanceUnavailable, match="stopped serving"):
        run_answer({"a": a}, FakeRouter("a", None, stall_after=10**6))


def test_a_request_that_failed_by_itself_is_not_sent_again():
    a, b = FakeInstance([ANSWER[:1]], error=True), FakeInstance([ANSWER])

    async def go() -> list[AnswerItem]:
        router = FakeRouter("a", "b", stall_after=10**6)
        answer = RoutedAnswer(router, {"a": a, "b": b}, RouterStates(router, max_age_s=0.0),
                              [1], SamplingParams(), "a", check_s=0.01)
        return [item async for item in answer.items()]

    items = asyncio.run(asyncio.wait_for(go(), 10))
    assert items == [AnswerItem(AnswerItemKind.ERROR, ANSWER[:1],
                                error="choosing its next token failed")]
    assert b.streams == []


def test_without_another_live_instance_the_answer_waits_then_gives_up():
    a = FakeInstance([ANSWER[:2]], hang=True)
    router = FakeRouter("a", None)

    async def first_items() -> list[int]:
        answer = RoutedAnswer(router, {"a": a}, RouterStates(router, max_age_s=0.0), [1],
                              SamplingParams(), "a", check_s=0.01, give_up_s=1.0)
        items = answer.items()
        got = list((await items.__anext__()).tokens)
        with pytest.raises(asyncio.TimeoutError):  # it waits for the stalled one a while
            await asyncio.wait_for(asyncio.shield(next_item := asyncio.ensure_future(
                items.__anext__())), 0.1)
        with pytest.raises(InstanceUnavailable, match="stalled"):  # then gives up
            await asyncio.wait_for(next_item, 5)
        return got

    assert asyncio.run(first_items()) == ANSWER[:2]
    assert len(a.streams) == 1 and a.streams[0].cancelled
    assert router.avoided and set(router.avoided) == {("a",)}


def test_an_instance_replacing_its_ranks_is_recovering_not_stalled():
    clock = Clock()
    live = Liveness(["a"], stall_timeout_s=2.0, clock=clock)
    live.answered("a", steps=1, busy=True, recovering=True)
    clock.now += 1.0
    assert live.answered("a", steps=1, busy=True, recovering=True) is InstanceState.LIVE
    clock.now += 1.5  # past the deadline without a step, answering: recovering
    assert live.answered("a", steps=1, busy=True, recovering=True) is \
        InstanceState.RECOVERING
    assert live.live() == set() and live.view("a").stalls == 0  # not chosen; no stall
    clock.now += 3.0  # its polls go unanswered too: stalled
    assert live.unanswered("a") is InstanceState.STALLED and live.view("a").stalls == 1
    assert live.answered("a", steps=2, busy=True) is InstanceState.LIVE  # it stepped


def test_a_recovering_instance_with_nowhere_else_is_waited_on():
    a = FakeInstance([ANSWER[:2], ANSWER[2:]])
    a.delay_s = 0.3  # each item comes long after give_up_s
    router = FakeRouter("a", None, stall_after=0, state="recovering")

    async def go() -> list[int]:
        answer = RoutedAnswer(router, {"a": a}, RouterStates(router, max_age_s=0.0), [1],
                              SamplingParams(), "a", check_s=0.01, give_up_s=0.05)
        got = []
        async for item in answer.items():
            got += item.tokens
        return got

    assert asyncio.run(asyncio.wait_for(go(), 10)) == ANSWER
    assert len(a.streams) == 1 and router.avoided  # it looked for another, then waited


def test_the_deadline_starts_when_first_asked_not_when_built():
    clock = Clock()
    live = Liveness(["a"], stall_timeout_s=2.0, clock=clock)
    clock.now += 60  # Serve built the router long before the first request
    assert live.live() == {"a"}
    clock.now += 2
    assert live.live() == set()
