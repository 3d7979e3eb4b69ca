"""The instance deployment of the serve graph: one model replica (its TP rank actors) behind
an `InstanceServer` (actors/serve_replica: streaming each request's tokens back to the
ingress, the router's poll, L3), with its snapshot, flush, pins and config.

One Serve replica per instance (each instance is its own deployment, `instance-<i>`), because
the router must send a request to the instance that holds its prefix, not to any replica.
The replica asks Ray for no CPU itself: its rank actors hold the instance's CPUs.
"""
from __future__ import annotations

from typing import Any

from ray import serve

from kvtier.actors.cluster_placement import rank_gpus
from kvtier.actors.instance import Instance
from kvtier.actors.instance_server import InstanceServer
from kvtier.actors.pins import pin_on_instance
from kvtier.actors.rank_actor import Rank, RankSettings
from kvtier.actors.serve_replica import (ServedReplica, final_fields,
                                         l3_options)  # l3_options: tests read it here too
from kvtier.calibration import calibrated_thresholds
from kvtier.dtypes import name as dtype_name, resolve_here
from kvtier.frontend.placement import RANK_STRATEGY, RankGpus, rank_resources
from kvtier.frontend.records import AnswerFinal, ReplicaConfig, ReplicaFlush
from kvtier.frontend.served_model import weight_source
from kvtier.frontend.settings import ModelChoice, ServeSettings
from kvtier.messages import pack_record, pack_records


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


def build_instance(s: ServeSettings, rank_class: type[Rank] = Rank) -> Instance:
    """One serving instance's rank actors, placed as the settings say."""
    gpu = rank_gpus(s) is RankGpus.ONE  # a GPU per rank where the nodes have them
    return Instance(rank_settings(s)._replace(gpu=gpu), tp_size=s.tp_size,
                    num_cpus_per_rank=s.num_cpus_per_rank, rank_class=rank_class,
                    strategy=RANK_STRATEGY, resources=rank_resources(s))


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  health_check_period_s=5, graceful_shutdown_timeout_s=20,
                  graceful_shutdown_wait_loop_s=0.2)
class InstanceDeployment(ServedReplica):
    def __init__(self, name: str, settings: dict,
                 rank_class: type[Rank] = Rank) -> None:
        """`rank_class`: what the rank actors run (tests pass one that injects faults)."""
        s = self._open(name, settings)
        self._serve(InstanceServer(build_instance(s, rank_class), name))

    def _final(self, out: Any) -> AnswerFinal:
        return final_fields(out, self.name)

    def _members(self, target: Instance) -> list[Instance]:
        return [target]

    # ---- router and operator calls ------------------------------------------------------------
    async def flush(self) -> bytes:
        """Drop every unlocked L1 and L2 page (L3 is untouched): a ReplicaFlush record."""
        free = await self._call(lambda inst: inst.drop_cache())
        return ReplicaFlush(self.name, free[0]).to_msgpack()

    # ---- pinned prefixes (the ingress's /admin/pin) ------------------------------------------
    async def pin(self, pin_id: str, tokens: list[int], salt: str, ttl_s: float,
                  max_fraction: float, tenant: str) -> bytes:
        """Pin the prefix on every rank (actors/pins): an InstancePin record, the pages
        pinned or the refusal with the room missing."""
        return pack_record(await self._call(lambda inst: pin_on_instance(
            inst, self.name, pin_id, tokens, salt, ttl_s, max_fraction, tenant)))

    async def held(self, tokens: list[int], salt: str) -> int:
        """Whole pages of the prefix every rank holds (L1 or L2)."""
        return min(await self._call(lambda inst: inst.rank_group.pin_held(tokens, salt)))

    async def unpin(self, pin_id: str) -> bool:
        return any(await self._call(lambda inst: inst.rank_group.unpin(pin_id)))

    async def pins(self) -> bytes:
        """Rank 0's live pins (every rank pins the same pages): PinListing records
        (`pack_records`)."""
        return pack_records((await self._call(lambda inst: inst.rank_group.pins()))[0])

    async def config(self) -> bytes:
        """What this instance's ranks run with: a ReplicaConfig record."""
        running = await self._call(lambda inst: inst.running_config())
        return ReplicaConfig(self.name, running).to_msgpack()
