"""The router deployment of the serve graph: where each request's prefix is cheapest to reuse.

It polls every instance (load, restart epoch, cache events) a few times a second, keeps the
approximate per-tier prefix index of `kvtier.serve.router_index`, and answers `choose(tokens)`
with an instance name. The ingress then streams from that instance directly: token traffic
never passes through the router.
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Any

from ray import serve

from kvtier.actors.ray_env import keep_serve_replica_on_loopback
from kvtier.keys import KeyNamespace
from kvtier.serve.cache_events import CacheEventBatch
from kvtier.serve.router_index import PrefixIndex, Router

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.1
POLL_TIMEOUT_S = 10.0


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=4096)
class RouterDeployment:
    def __init__(self, instances: dict[str, Any]) -> None:
        keep_serve_replica_on_loopback()
        self.handles = instances
        self.router = Router(PrefixIndex())
        self.loads = {name: 0 for name in instances}
        self.epochs: dict[str, int] = {}
        self.broken: dict[str, str] = {}
        self.routed = {name: 0 for name in instances}
        self.reasons: dict[str, int] = {}
        self._keys: tuple[KeyNamespace, int] | None = None
        self._rng = random.Random()
        self._poller: asyncio.Task | None = None

    async def choose(self, tokens: list[int]) -> dict:
        """The instance to serve `tokens`: {"instance", "reason", "hits" (pages by tier)}."""
        self._ensure_poller()
        keys, page_size = await self._key_namespace()
        hashes = keys.page_hashes(tokens, page_size)
        healthy = {n: load for n, load in self.loads.items() if n not in self.broken}
        choice = self.router.choose(hashes, healthy or self.loads, self._rng)
        self.loads[choice.instance] += 1  # counted until the next poll says otherwise
        self.routed[choice.instance] += 1
        self.reasons[choice.reason.value] = self.reasons.get(choice.reason.value, 0) + 1
        return {"instance": choice.instance, "reason": choice.reason.value,
                "hits": choice.hits._asdict()}

    async def status(self) -> dict:
        """Per instance: load, epoch, why it is broken (if it is), requests routed to it."""
        self._ensure_poller()
        return {"instances": {n: {"load": self.loads[n], "epoch": self.epochs.get(n),
                                  "broken": self.broken.get(n), "routed": self.routed[n],
                                  "indexed_pages": self.router.index.num_pages(n)}
                              for n in self.handles},
                "storage_pages": self.router.index.num_storage_pages,
                "reasons": dict(self.reasons)}

    async def sync(self) -> None:
        """Poll every instance now (tests: the index reflects everything finished so far)."""
        await self._poll_all()

    # ---- polling ------------------------------------------------------------------------------
    def _ensure_poller(self) -> None:
        if self._poller is None or self._poller.done():
            self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def _poll_forever(self) -> None:
        while True:
            try:
                await self._poll_all()
            except Exception:  # noqa: BLE001 - the router keeps routing on what it knows
                log.exception("router: polling the instances failed")
            await asyncio.sleep(POLL_INTERVAL_S)

    async def _poll_all(self) -> None:
        names = list(self.handles)
        results = await asyncio.gather(
            *(asyncio.wait_for(self.handles[n].poll.remote(), POLL_TIMEOUT_S) for n in names),
            return_exceptions=True)
        for name, res in zip(names, results):
            if isinstance(res, BaseException):
                self.broken[name] = f"poll failed: {type(res).__name__}: {res}"
                continue
            self._apply(name, res)

    def _apply(self, name: str, poll: dict) -> None:
        if poll["broken"]:
            self.broken[name] = poll["broken"]
        else:
            self.broken.pop(name, None)
        if self.epochs.get(name) != poll["epoch"]:
            self.router.index.forget(name)  # new ranks: new caches, events from seq 1 again
            self.epochs[name] = poll["epoch"]
        for data in poll["events"]:
            self.router.apply(CacheEventBatch.from_msgpack(data))
        self.loads[name] = poll["load"]

    async def _key_namespace(self) -> tuple[KeyNamespace, int]:
        """The instances' page-key namespace (they are built alike: any one answers)."""
        if self._keys is None:
            desc = await next(iter(self.handles.values())).describe.remote()
            self._keys = (KeyNamespace(desc["model"], desc["tenant_salt"],
                                       desc["layout_fingerprint"]), desc["page_size"])
        return self._keys
