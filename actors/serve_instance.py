"""The instance deployment of the serve graph: one model replica (its TP rank actors) behind
an `InstanceServer`, streaming each request's tokens back to the ingress.

One Serve replica per instance (each instance is its own deployment, `instance-<i>`), because
the router must send a request to the instance that holds its prefix, not to any replica.
The replica asks Ray for no CPU itself: its rank actors hold the instance's CPUs.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator

import torch
from ray import serve

from kvtier.actors.cluster_placement import rank_gpus
from kvtier.actors.instance import Instance, InstanceError
from kvtier.actors.instance_pins import pin_on_instance
from kvtier.actors.instance_server import InstanceServer
from kvtier.actors.ray_env import keep_serve_replica_on_loopback
from kvtier.actors.rank_actor import RankCache, RankSettings
from kvtier.actors.step_wire import logprobs_to_wire
from kvtier.calibration import calibrated_thresholds
from kvtier.dtypes import name as dtype_name, resolve_here
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError
from kvtier.messages import NamespaceSpec
from kvtier.serve.placement import RANK_STRATEGY, RankGpus, head_resources, rank_resources
from kvtier.serve.served_model import weight_source
from kvtier.serve.settings import ModelChoice, ServeSettings
from kvtier.storage_options import parse_storage_options
from kvtier.policies import StorageBackendKind

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 120.0


def rank_settings(s: ServeSettings) -> RankSettings:
    """What every rank of a serving instance is built from."""
    source = weight_source(s)
    config = s.cache_config()
    if s.model is ModelChoice.SMOLLM2:  # load thresholds from this machine's measured
        config = calibrated_thresholds(  # crossover, if cached
            config, dtype=dtype_name(resolve_here(s.dtype)))
    # A serving step is one forward of up to chunk_tokens (prefill pieces and every decode):
    # a long prompt never holds the running decodes (or the router's stall deadline) for
    # several forwards. Deterministic mode runs one-page chunks, one per forward: its step
    # keeps a larger budget.
    budget = max(8192, 2 * s.chunk_tokens) if s.deterministic else s.chunk_tokens
    return RankSettings(source, config, device_pages=s.device_pages, dtype=s.dtype,
                        chunk_tokens=s.chunk_tokens, token_budget=budget,
                        l3=None, l3_actor=None, tenant_salt=s.tenant_salt,
                        deterministic=s.deterministic, schedule_policy=s.schedule_policy)


def l3_options(kind: StorageBackendKind, s: ServeSettings, options: dict | None) -> dict:
    """The backend options a namespace is registered with (validated); file and nixl keep
    their pages under the deployment's L3 directory unless the caller names one, bounded by
    l3_max_gb (the namespace's quota) unless the caller bounds them."""
    opts = dict(options or {})
    on_disk = kind in (StorageBackendKind.FILE, StorageBackendKind.NIXL)
    if on_disk and "root_dir" not in opts:
        if not s.l3_root:
            raise ConfigError("the file and nixl backends need a directory: set l3_root or "
                              "give options.root_dir")
        opts["root_dir"] = s.l3_root
    if s.l3_max_gb and on_disk:
        opts.setdefault("max_size_bytes", int(s.l3_max_gb * 2**30))
    elif s.l3_max_gb:
        raise ConfigError(f"l3_max_gb bounds a file or nixl L3; a {kind.value} store is bounded "
                          f"by its own configuration (Mooncake: the master's segment size)")
    parse_storage_options(kind, opts)  # ConfigError names a bad key or value
    return opts


def _logprobs(logprobs: tuple | None, start: int) -> dict:
    """{"logprobs": the wire form of those from `start` on} when the request asked, or {}."""
    return {} if logprobs is None else {"logprobs": logprobs_to_wire(logprobs[start:])}


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  health_check_period_s=5, graceful_shutdown_timeout_s=20)
class InstanceDeployment:
    def __init__(self, name: str, settings: dict,
                 rank_class: type[RankCache] = RankCache) -> None:
        """`rank_class`: what the rank actors run (tests pass one that injects faults)."""
        keep_serve_replica_on_loopback()
        torch.set_num_threads(1)
        self.name, self.settings = name, ServeSettings.from_mapping(settings)
        s = self.settings
        gpu = rank_gpus(s) is RankGpus.ONE  # a GPU per rank where the nodes have them
        instance = Instance(rank_settings(s)._replace(gpu=gpu), tp_size=s.tp_size,
                            num_cpus_per_rank=s.num_cpus_per_rank, rank_class=rank_class,
                            strategy=RANK_STRATEGY, resources=rank_resources(s))
        self.server = InstanceServer(instance, name)
        self.l3: dict[str, Any] | None = None
        if s.storage_backend is not None:
            self._attach(s.storage_backend, l3_options(s.storage_backend, s, None))

    # ---- requests ---------------------------------------------------------------------------
    async def generate(self, tokens: list[int], sampling: dict,
                       cache_salt: str = "") -> AsyncIterator[dict]:
        """Stream `{"tokens": [...new ids]}` items, the last one with the finish reason,
        cached tokens by tier, the five lengths and the instance-side TTFT. `cache_salt`:
        the request's tenant (it hits only prefixes cached with the same salt)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        key = self.server.submit(tokens, SamplingParams(**sampling),
                                 lambda item: loop.call_soon_threadsafe(queue.put_nowait, item),
                                 cache_salt)
        emitted, finished = 0, False
        try:
            while True:
                kind, value = await queue.get()
                if kind == "tokens":  # a Progress: the output so far
                    if len(value.tokens) > emitted:
                        yield {"tokens": list(value.tokens[emitted:]),
                               **_logprobs(value.logprobs, emitted)}
                        emitted = len(value.tokens)
                elif kind == "done":
                    finished = True
                    yield {"tokens": list(value.tokens[emitted:]),
                           **_logprobs(value.logprobs, emitted),
                           "finish_reason": value.finish_reason.value,
                           "cached": value.cached._asdict(),
                           "lengths": value.lengths._asdict(),
                           "ttft_s": value.ttft_s, "queue_s": value.queue_s,
                           "instance": self.name}
                    return
                else:
                    finished = True
                    raise InstanceError(f"instance {self.name}: {value}")
        finally:
            if not finished:  # the caller went away (disconnect, stop string): free it
                self.server.cancel(key)

    # ---- router and operator calls ------------------------------------------------------------
    async def poll(self) -> dict:
        return self.server.poll()._asdict()

    async def describe(self) -> dict:
        desc = await self._call(lambda inst: inst.describe())
        return {**desc._asdict(), "instance": self.name, "tp_size": self.settings.tp_size}

    async def snapshot(self) -> dict:
        """Rank 0's counters and pool use (the ranks of an instance mirror each other)."""
        snaps = await self._call(lambda inst: inst.cache_snapshot())
        instance = self.server.instance
        restarts = instance.restarts
        return {**snaps[0], "counters": {**snaps[0]["counters"], "rank_restarts": restarts,
                                         "rank_divergences": instance.divergences},
                "restarts": restarts}

    async def flush(self) -> dict:
        """Drop every unlocked L1 and L2 page (L3 is untouched)."""
        free = await self._call(lambda inst: inst.drop_cache())
        return {"instance": self.name, "free_device_pages": free[0]}

    async def attach_l3(self, backend: str, options: dict | None) -> dict:
        kind = StorageBackendKind.parse(backend, "backend")
        opts = l3_options(kind, self.settings, options)
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: self._attach(kind, opts))

    async def detach_l3(self) -> dict:
        await self._call(lambda inst: inst.detach_l3())
        self.l3 = None
        return {"instance": self.name, "l3": None}

    # ---- pinned prefixes (the ingress's /admin/pin) ------------------------------------------
    async def pin(self, pin_id: str, tokens: list[int], salt: str, ttl_s: float,
                  max_fraction: float, tenant: str) -> dict:
        """Pin the prefix on every rank (actors/instance_pins): the pages pinned, or the
        refusal with the room missing."""
        return await self._call(lambda inst: pin_on_instance(
            inst, self.name, pin_id, tokens, salt, ttl_s, max_fraction, tenant))

    async def held(self, tokens: list[int], salt: str) -> int:
        """Whole pages of the prefix every rank holds (L1 or L2)."""
        return min(await self._call(lambda inst: inst.call_all("pin_held", tokens, salt)))

    async def unpin(self, pin_id: str) -> bool:
        return any(await self._call(lambda inst: inst.call_all("unpin", pin_id)))

    async def pins(self) -> list[dict]:
        """Rank 0's pins (every rank pins the same pages); expired ones are dropped first."""
        return (await self._call(lambda inst: inst.call_all("pins")))[0]

    async def config(self) -> dict:
        """What this instance's ranks run with (rank 0 speaks for them: they are built from
        the same settings)."""
        running = await self._call(lambda inst: inst.running_config())
        return {"instance": self.name, **running}

    async def storage(self) -> dict:
        return {"instance": self.name, "l3": self.l3}

    def check_health(self) -> None:
        if self.server.broken:
            raise RuntimeError(f"instance {self.name} stopped serving: {self.server.broken}")

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.close()

    # ---- helpers ------------------------------------------------------------------------------
    async def _call(self, fn) -> Any:
        future = self.server.call(fn)
        return await asyncio.wait_for(asyncio.wrap_future(future), CALL_TIMEOUT_S)

    def _attach(self, kind: StorageBackendKind, options: dict) -> dict:
        """Register this instance's namespace with the namespace actor (idempotent: every
        instance of the deployment registers the same one) and attach it on every rank."""
        from kvtier.actors.namespace_actor import get_or_create_namespace_actor

        if self.l3 is not None:
            raise ConfigError(f"instance {self.name} has L3 attached already "
                              f"({self.l3['backend']}); detach it first")
        server, s = self.server, self.settings
        desc = server.call(lambda inst: inst.describe()).result(CALL_TIMEOUT_S)
        client = get_or_create_namespace_actor(s.l3_actor, s.l3_state_dir or None,
                                               resources=head_resources(s))
        info = client.register(NamespaceSpec(desc.model, desc.tenant_salt,
                                             desc.layout_fingerprint, kind, options,
                                             kv_heads=desc.kv_heads,
                                             page_bytes=desc.page_bytes,
                                             sliding=desc.sliding))
        server.call(lambda inst: inst.attach_l3(info, s.l3_actor)).result(CALL_TIMEOUT_S)
        self.l3 = {"backend": kind.value, "namespace": info.namespace,
                   "options": {k: v for k, v in options.items()}}
        log.info("instance %s: L3 %s attached (namespace %s)", self.name, kind.value,
                 info.namespace)
        return {"instance": self.name, "l3": self.l3}
