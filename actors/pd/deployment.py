"""The prefill/decode deployment of the serve graph: P prefill instances and D decode
instances (each built as an instance deployment builds its one) driven by one `PDDriver`
behind an `InstanceServer`, streaming each request's tokens back to the ingress.

Why one deployment that looks like one instance to the router and the ingress: every stage
of a request (a decode instance reserving pages, the prefill, the transfer, KV-ready, decode)
is a step of the driver, which must see both sides at once; so the router's single choice is
this deployment, and the ingress streams from it as from any instance (re-dispatch, cancel
on disconnect, n answers, log-probabilities all unchanged). Inside, the driver takes the
prefill instance holding most of the prompt in L1/L2 (then the least loaded) and the least
loaded decode instance with room (then the one holding most of the prompt). Each answer's
last item tells how it went (`kvtier.pd`).

Pinned prefixes are refused at the ingress; flush, config, L3 attach and detach cover every
instance; the metrics feed gets each instance's snapshot by its own name (`prefill-0`, ...).
"""
from __future__ import annotations

from typing import Any

from ray import serve

from kvtier.actors.instance import Instance, InstanceStep
from kvtier.actors.instance_server import InstanceServer
from kvtier.actors.pd.driver import PDDriver, PDOutput
from kvtier.actors.rank_actor import Rank
from kvtier.actors.serve_instance import build_instance
from kvtier.actors.serve_replica import ServedReplica
from kvtier.engine.request import Resume
from kvtier.engine.sampling import SamplingParams
from kvtier.frontend.openai_responses import pd_report
from kvtier.frontend.records import AnswerFinal, ReplicaConfig, ReplicaFlush
from kvtier.frontend.settings import ServeSettings

PD_NAME = "pd"


def member_names(s: ServeSettings) -> list[str]:
    """The instances of a prefill/decode deployment: `prefill-<i>`, then `decode-<i>`."""
    return ([f"prefill-{i}" for i in range(s.prefill_instances)]
            + [f"decode-{i}" for i in range(s.decode_instances)])


class PDInstances:
    """A PDDriver as `InstanceServer` drives an Instance (a `DrivenInstance`, actors/
    instance_server). It reports no cache events: the router has one deployment to choose."""

    events_when_idle = False  # it reports none

    def __init__(self, driver: PDDriver) -> None:
        self.driver = driver
        self.members: list[Instance] = [*driver.prefill, *driver.decode]

    def watch_cache(self, name: str) -> None:
        pass

    def drain_events(self) -> None:
        return None

    def add_request(self, tokens: Any, sampling: SamplingParams, cache_salt: str = "",
                    resume: Resume | None = None, request_id: int | None = None,
                    label: str = "") -> int:
        return self.driver.add(tokens, sampling, cache_salt, resume, request_id, label)

    def abort(self, request_id: int) -> None:
        self.driver.abort(request_id)

    def step_report(self) -> InstanceStep:
        step = self.driver.step_report()
        return InstanceStep(step.finished, step.progress, None)

    @property
    def num_pending(self) -> int:
        return self.driver.num_pending

    @property
    def restarts(self) -> int:
        return self.driver.restarts

    @property
    def recovering(self) -> bool:
        return any(inst.recovering for inst in self.members)

    def close(self) -> None:
        self.driver.close()


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
                  health_check_period_s=5, graceful_shutdown_timeout_s=20,
                  graceful_shutdown_wait_loop_s=0.2)
class PDDeployment(ServedReplica):
    def __init__(self, name: str, settings: dict,
                 rank_class: type[Rank] = Rank) -> None:
        """`rank_class`: what the rank actors run (tests pass one that injects faults)."""
        s = self._open(name, settings)
        self.names = member_names(s)
        built: list[Instance] = []
        try:
            for _ in self.names:
                built.append(build_instance(s, rank_class))
            driver = PDDriver(built[:s.prefill_instances], built[s.prefill_instances:],
                              transport=s.pd_transport.value)
        except BaseException:
            for inst in built:
                inst.close()
            raise
        self._serve(InstanceServer(PDInstances(driver), name))

    def _member_names(self) -> list[str]:
        return list(self.names)

    def _members(self, target: PDInstances) -> list[Instance]:
        return target.members

    def _l3_members(self, target: PDInstances) -> list[Instance]:
        """Every instance, or the prefill ones only with --no-pd-decode-l3 (decode instances
        then keep finished conversations in their own L1/L2)."""
        if self.settings.pd_decode_l3:
            return target.members
        return target.members[:self.settings.prefill_instances]

    def _final(self, out: PDOutput) -> AnswerFinal:
        s = self.settings
        decode = None if out.decode_instance < 0 else self.names[s.prefill_instances
                                                                 + out.decode_instance]
        pd = pd_report(out.mode.value, s.pd_transport.value, self.names[out.prefill_instance],
                       decode, out.stages, out.transfer_bytes, out.transfer_pages)
        return AnswerFinal.of(out, self.name, pd)

    # ---- operator calls -----------------------------------------------------------------------
    async def flush(self) -> bytes:
        """Drop every unlocked L1 and L2 page of every instance (L3 is untouched): a
        ReplicaFlush record."""
        free = await self._call(lambda target: [inst.drop_cache()[0]
                                                for inst in target.members])
        return ReplicaFlush(self.name, sum(free), dict(zip(self.names, free))).to_msgpack()

    async def config(self) -> bytes:
        """What the instances' ranks run with (the first instance's rank 0 speaks for all:
        they are built from the same settings), and the prefill/decode layout."""
        running = await self._call(lambda target: target.members[0].running_config())
        s = self.settings
        return ReplicaConfig(self.name, running, tuple(self.names[:s.prefill_instances]),
                             tuple(self.names[s.prefill_instances:]),
                             s.pd_transport.value).to_msgpack()
