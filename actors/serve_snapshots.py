"""The ingress's metrics feed: every few seconds it asks the router for each instance's
liveness, each live instance for its cache snapshot, and the L3 namespace actor for the
namespace's directory figures, and folds them into the deployment's `ServeMetrics`.

A feed of its own because it runs beside the request path (one task, started by the first
request or scrape, restarted if it ever ends), and every call is bounded: a stalled or
unreachable instance, router or namespace actor costs a missed sample, never a request.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Any

from kvtier.frontend.metrics import MetricsError, ServeMetrics
from kvtier.frontend.records import InstanceSnapshot, ReplicaSnapshot, ReplicaStorage, RouterStatus

log = logging.getLogger(__name__)

SNAPSHOT_INTERVAL_S = 2.0
CALL_TIMEOUT_S = 30.0


class SnapshotFeed:
    """Feeds `metrics` from the router, the instances and the L3 namespace actor."""

    def __init__(self, router: Any, instances: dict[str, Any], metrics: ServeMetrics,
                 l3_actor: str) -> None:
        self.router, self.instances, self.metrics = router, instances, metrics
        self.l3_actor = l3_actor  # the namespace actor's name
        self._task: asyncio.Task | None = None

    def ensure_running(self) -> None:
        """Start the feed (from the event loop) unless it runs."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._forever())

    async def _forever(self) -> None:
        while True:
            stalled = await self._observe_liveness()
            for name, handle in self.instances.items():
                if name in stalled:  # its replica may not answer: do not wait on it
                    continue
                try:
                    snap = ReplicaSnapshot.from_msgpack(
                        await asyncio.wait_for(handle.snapshot.remote(), CALL_TIMEOUT_S))
                except Exception as exc:  # noqa: BLE001 - metrics must not stop serving
                    log.debug("snapshot of %s failed: %s", name, exc)
                    continue
                # a prefill/decode deployment: each of its instances by its own name
                for one in snap.instances:
                    try:
                        self._observe_snapshot(one)
                    except MetricsError:  # a counter no type declares: said, not dropped
                        log.exception("the metrics of %s could not be read", one.name)
            await self._observe_namespace(stalled)
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)

    def _observe_snapshot(self, snap: InstanceSnapshot) -> None:
        name = snap.name
        self.metrics.update_cache(name, snap.counters, snap.host_used_tokens,
                                  snap.host_total_tokens, snap.storage)
        self.metrics.update_gauges(name, snap.gauges)
        self.metrics.update_pins(name, snap.pins)
        self.metrics.observe_agreement(name, snap.agreement_s)

    async def _observe_liveness(self) -> set[str]:
        """Feed the router's per-instance stall counts to the metrics; the stalled ones."""
        try:
            status = RouterStatus.from_msgpack(
                await asyncio.wait_for(self.router.status.remote(), CALL_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - metrics must not stop serving
            log.debug("router status failed: %s", exc)
            return set()
        stalled = status.stalled()
        for info in status.instances:
            self.metrics.update_liveness(info.name, info.stalls, info.name in stalled)
        return stalled

    async def _observe_namespace(self, stalled: set[str]) -> None:
        """Feed the L3 namespace's directory figures (evictions, pages held), asked of the
        namespace actor for the namespace an instance reports attached."""
        try:
            namespace = None
            for name, handle in self.instances.items():
                if name not in stalled:
                    l3 = ReplicaStorage.from_msgpack(
                        await asyncio.wait_for(handle.storage.remote(), CALL_TIMEOUT_S)).l3
                    namespace = None if l3 is None else l3.namespace
                    break
            if namespace:
                stats = await asyncio.get_running_loop().run_in_executor(
                    None, self._namespace_stats, namespace)
                self.metrics.update_namespace(namespace, stats)
        except Exception as exc:  # noqa: BLE001 - metrics must not stop serving
            log.debug("L3 namespace stats failed: %s", exc)

    def _namespace_stats(self, namespace: str) -> dict:
        """The directory's figures of `namespace` (a blocking actor call: run off the loop)."""
        import ray

        from kvtier.actors.l3.namespace_actor import RAY_NAMESPACE, NamespaceClient

        handle = ray.get_actor(self.l3_actor, namespace=RAY_NAMESPACE)
        return dataclasses.asdict(NamespaceClient(handle).stats(namespace))
