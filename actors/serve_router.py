"""The router deployment of the serve graph: where each request's prefix is cheapest to reuse.

It polls every instance (load, restart epoch, steps, cache events) a few times a second, each
on its own so that one unreachable instance does not hold up the others, keeps the
approximate per-tier prefix index of `kvtier.frontend.router_index`, and answers `choose(tokens)`
with an instance name. Its first poll of an instance, and any poll after it missed batches,
asks for what the instance holds (`poll(full=True)`): a router that starts again (its replica
replaced) rebuilds its index from the instances, not from the requests that come next. The
ingress then streams from that instance directly: token traffic never passes through the
router. An instance that stops stepping with work waiting, or stops
answering polls, for `stall_timeout_s` is stalled (`kvtier.frontend.liveness`): it is not
chosen until it steps again, and the ingress moves its unanswered requests elsewhere.
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from ray import serve

from kvtier.actors.ray_env import keep_serve_replica_on_loopback
from kvtier.keys import KeyNamespace
from kvtier.frontend.cache_events import CacheEventBatch
from kvtier.frontend.liveness import Liveness, candidates
from kvtier.frontend.records import (InstanceStates, InstanceStatus, NamedState,
                                     ReplicaDescription, ReplicaPoll, Route, RouterStatus)
from kvtier.frontend.router_index import PrefixIndex, Router
from kvtier.frontend.settings import ServeSettings

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096,
                  graceful_shutdown_wait_loop_s=0.2)
class RouterDeployment:
    def __init__(self, instances: dict[str, Any], settings: dict | None = None) -> None:
        keep_serve_replica_on_loopback()
        self.handles = instances
        serve_settings = ServeSettings.from_mapping(settings or {})
        stall_timeout_s = serve_settings.stall_timeout_s
        self.liveness = Liveness(instances, stall_timeout_s)
        self.poll_timeout_s = stall_timeout_s  # a poll that long unanswered stalls it anyway
        self.router = Router(PrefixIndex(), peers=serve_settings.peer_transport is not None)
        self.loads = {name: 0 for name in instances}
        self.epochs: dict[str, int] = {}
        self.broken: dict[str, str] = {}
        self.routed = {name: 0 for name in instances}
        self.reasons: dict[str, int] = {}
        self._keys: tuple[KeyNamespace, int] | None = None
        self._rng = random.Random()
        self._pollers: dict[str, asyncio.Task] = {}
        self._rebuilt: set[str] = set()  # instances whose holdings the index was built from

    async def choose(self, tokens: list[int], avoid: tuple[str, ...] = (),
                     cache_salt: str = "") -> bytes:
        """The instance to serve `tokens`: a `Route` record (msgpack: the instance, why, the
        pages it expects hit by tier). `avoid`: instances it is leaving (stalled); when no
        other instance is live and unbroken, its instance is None (the caller keeps waiting
        where it is). `cache_salt`: the request's (its pages' keys are of that salt's
        chain)."""
        self._ensure_poller()
        keys, page_size = await self._key_namespace()
        hashes = keys.page_hashes(tokens, page_size, cache_salt)
        stalled = set(self.loads) - self.liveness.live()
        healthy = candidates(self.loads, {*self.broken, *stalled, *avoid})
        if not healthy and avoid:
            return Route(None).to_msgpack()
        choice = self.router.choose(hashes, healthy or self.loads, self._rng)
        self.loads[choice.instance] += 1  # counted until the next poll says otherwise
        self.routed[choice.instance] += 1
        self.reasons[choice.reason.value] = self.reasons.get(choice.reason.value, 0) + 1
        return Route.of(choice).to_msgpack()

    async def status(self) -> bytes:
        """A `RouterStatus` record (msgpack): per instance its load, epoch, why it is broken
        (if it is), requests routed to it, its state (live, stalled or recovering), seconds
        since it last showed progress, its stalls."""
        self._ensure_poller()
        return RouterStatus(tuple(self._status(n) for n in self.handles),
                            self.router.index.num_storage_pages,
                            dict(self.reasons)).to_msgpack()

    async def states(self) -> bytes:
        """An `InstanceStates` record (msgpack): each instance's state, live, stalled or
        recovering (what the ingress watches)."""
        self._ensure_poller()
        return InstanceStates(tuple(NamedState(n, self.liveness.state(n))
                                    for n in self.handles)).to_msgpack()

    async def sync(self) -> None:
        """Poll every instance now (tests: the index reflects everything finished so far)."""
        await self._poll_all()

    # ---- polling ------------------------------------------------------------------------------
    def _status(self, name: str) -> InstanceStatus:
        view = self.liveness.view(name)
        return InstanceStatus(name, self.loads[name], self.epochs.get(name),
                              self.broken.get(name), self.routed[name],
                              self.router.index.num_pages(name), view.state,
                              round(view.quiet_s, 3), view.stalls)

    def _ensure_poller(self) -> None:
        loop = asyncio.get_running_loop()
        for name in self.handles:
            task = self._pollers.get(name)
            if task is None or task.done():
                self._pollers[name] = loop.create_task(self._poll_forever(name))

    async def _poll_forever(self, name: str) -> None:
        while True:
            try:
                await self._poll(name)
            except Exception:  # noqa: BLE001 - the router keeps routing on what it knows
                log.exception("router: polling %s failed", name)
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(n) for n in self.handles))

    async def _poll(self, name: str) -> None:
        full = name not in self._rebuilt or self.router.index.is_stale(name)
        try:
            res = await asyncio.wait_for(self.handles[name].poll.remote(full),
                                         self.poll_timeout_s)
        except asyncio.TimeoutError:
            self.liveness.unanswered(name)
            return
        except Exception as exc:  # noqa: BLE001 - an unreachable or dead replica
            self.broken[name] = f"poll failed: {type(exc).__name__}: {exc}"
            self.liveness.unanswered(name)
            return
        self._apply(name, ReplicaPoll.from_msgpack(res), full)

    def _apply(self, name: str, poll: ReplicaPoll, full: bool = False) -> None:
        if poll.broken:
            self.broken[name] = poll.broken
        else:
            self.broken.pop(name, None)
        if self.epochs.get(name) != poll.epoch:
            self.router.index.forget(name)  # new ranks: new caches, events from seq 1 again
            self.epochs[name] = poll.epoch
        if full:  # what it holds, in place of what the index knew
            self.router.index.forget(name)
            if poll.holdings is not None:
                self.router.index.restore(CacheEventBatch.from_msgpack(poll.holdings))
            self._rebuilt.add(name)
        for data in poll.events:
            self.router.apply(CacheEventBatch.from_msgpack(data))
        self.loads[name] = poll.load
        self.liveness.answered(name, poll.steps, busy=poll.load > 0,
                               recovering=poll.recovering)

    async def _key_namespace(self) -> tuple[KeyNamespace, int]:
        """The instances' page-key namespace (they are built alike: any one answers)."""
        if self._keys is None:
            desc = ReplicaDescription.from_msgpack(
                await next(iter(self.handles.values())).describe.remote())
            self._keys = (desc.key_namespace, desc.page_size)
        return self._keys
