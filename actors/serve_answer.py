"""One request's answer as the ingress reads it: from the instance the router chose, or, if
that instance stalls (the router says so) or its stream fails while the answer is
outstanding, from another one, going on after the tokens already passed on.

The pure half is `kvtier.frontend.redispatch` (what was passed on) and `kvtier.frontend.liveness`
(when an instance is stalled, decided by the router); this module holds the Ray calls. While
no item comes, the answer asks the router's states every `check_s`; when its instance is
stalled it asks the router for another live one, sends the request there with the tokens
already passed on as the start of its answer, and cancels the first stream (the instance
aborts the request if the cancel reaches it; if not, its late items are never read). With no
other live instance it waits `give_up_s` for the stalled one to step again, then raises
InstanceUnavailable (the client gets a 503), never waiting without end.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, AsyncIterator, Callable

from kvtier.actors.step_wire import encode_resume, encode_sampling
from kvtier.engine.sampling import SamplingParams
from kvtier.frontend.liveness import InstanceState
from kvtier.frontend.records import AnswerItem, InstanceStates, Route
from kvtier.frontend.redispatch import InstanceUnavailable, SentTokens

log = logging.getLogger(__name__)

ROUTER_CALL_TIMEOUT_S = 5.0


class RouterStates:
    """The router's instance states, fetched at most every `max_age_s` however many requests
    ask (one call in flight at a time)."""

    def __init__(self, router: Any, max_age_s: float) -> None:
        self._router, self._max_age_s = router, max_age_s
        self._states = InstanceStates(())
        self._at = -math.inf
        self._fetch: asyncio.Task | None = None

    async def state(self, name: str) -> InstanceState:
        """The router's state of `name` (LIVE while the router cannot say)."""
        if time.monotonic() - self._at >= self._max_age_s:
            if self._fetch is None or self._fetch.done():
                self._fetch = asyncio.get_running_loop().create_task(self._refresh())
            try:
                await asyncio.shield(self._fetch)
            except Exception as exc:  # noqa: BLE001 - keep waiting on what we have
                log.warning("the router's instance states are unavailable: %s", exc)
        return self._states.of(name)

    async def _refresh(self) -> None:
        self._states = InstanceStates.from_msgpack(await asyncio.wait_for(
            self._router.states.remote(), ROUTER_CALL_TIMEOUT_S))
        self._at = time.monotonic()


class RoutedAnswer:
    """`items()`: the answer's items (`AnswerItem` records, decoded from the replica's
    stream), each with only the tokens not passed on before; `cancel()` frees the instance
    serving it. `request_id`: the answer's id as its client knows it (the OpenAI id), which
    every instance it runs on is given, a re-dispatch too, and the logs say."""

    def __init__(self, router: Any, instances: dict[str, Any], states: RouterStates,
                 tokens: list[int], sampling: SamplingParams, instance: str, check_s: float,
                 on_move: Callable[[str], None] = lambda _: None, cache_salt: str = "",
                 give_up_s: float | None = None, request_id: str = "") -> None:
        self._router, self._instances, self._states = router, instances, states
        self.request_id = request_id
        self._tokens, self._sampling, self._check_s = tokens, sampling, check_s
        self._salt = cache_salt
        self._on_move = on_move  # called with the name of the instance the answer left
        self._give_up_s = 4 * check_s if give_up_s is None else give_up_s
        self._alone_since: float | None = None  # stalled with nowhere to go since then
        self.instance = instance
        self.sent = SentTokens()
        self._stream = self._open(instance)
        self._next: asyncio.Future | None = None
        self._finished = False

    @property
    def moves(self) -> int:
        """The instances the answer left (stalled, or their stream failed)."""
        return self.sent.moves

    async def items(self) -> AsyncIterator[AnswerItem]:
        while True:
            if self._next is None:
                self._next = asyncio.ensure_future(self._stream.__anext__())
            done, _ = await asyncio.wait({self._next}, timeout=self._check_s)
            if not done:
                state = await self._states.state(self.instance)
                if state is InstanceState.STALLED:
                    await self._move(f"instance {self.instance} stalled", failed=False)
                elif state is InstanceState.RECOVERING:  # with nowhere else, it waits
                    await self._move(f"instance {self.instance} is replacing its ranks",
                                     failed=False, patient=True)
                continue
            next_, self._next = self._next, None
            try:
                raw = next_.result()
            except StopAsyncIteration:  # ended without its last item: the replica went away
                await self._move(f"instance {self.instance} ended the answer early",
                                 failed=True)
                continue
            except Exception as exc:  # noqa: BLE001 - the instance stopped or its replica died
                log.warning("request %s: instance %s failed with it in flight: %s",
                            self.request_id, self.instance, exc)
                await self._move(f"instance {self.instance} stopped serving", failed=True)
                continue
            item = AnswerItem.from_msgpack(raw)  # a bad record is a bug: raised, not moved
            self._alone_since = None
            self.sent.add(item.tokens, item.logprobs)
            self._finished = item.last
            yield item
            if self._finished:
                return

    def cancel(self) -> None:
        """Abort the request where it runs now (nothing is pending after its last item)."""
        if self._next is not None:
            self._next.cancel()
            self._next = None
        if not self._finished:
            self._stream.cancel()

    def _open(self, instance: str) -> Any:
        handle = self._instances[instance]
        return handle.options(stream=True).generate.remote(
            self._tokens, encode_sampling(self._sampling), self._salt,
            encode_resume(self.sent.resume(self._sampling.logprobs is not None)),
            self.request_id)

    async def _move(self, why: str, failed: bool, patient: bool = False) -> None:
        """Send the request to another live instance, which goes on after what was passed
        on. With none: a failed stream (`failed`) gives up at once; a stalled instance is
        waited on for `give_up_s`, one replacing its ranks (`patient`) as long as it takes.
        InstanceUnavailable when given up."""
        choice = None
        try:
            choice = Route.from_msgpack(await asyncio.wait_for(
                self._router.choose.remote(self._tokens, avoid=(self.instance,),
                                           cache_salt=self._salt),
                ROUTER_CALL_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - as if no other instance were live
            log.warning("request %s: re-dispatching from %s: the router did not answer: %s",
                        self.request_id, self.instance, exc)
        if choice is None or choice.instance is None:
            now = time.monotonic()
            if patient:
                self._alone_since = None
                return
            self._alone_since = self._alone_since or now
            if failed or now - self._alone_since >= self._give_up_s:
                self.cancel()
                raise InstanceUnavailable(f"{why} and no other instance is live")
            return  # wait where it is: the deadline is checked again
        left, self.instance = self.instance, choice.instance
        log.warning("request %s: %s with it in flight (%d tokens sent): re-dispatched to %s",
                    self.request_id, why, len(self.sent.ids), self.instance)
        self.cancel()
        self._alone_since = None
        self._stream = self._open(self.instance)
        self.sent.moves += 1
        self._on_move(left)
