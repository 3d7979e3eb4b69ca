"""An Instance: the TP rank actors of one model replica, stepped in lockstep.

The ranks sit in one placement group (PACK: on one node when it fits). Every request goes to
every rank in the same order; each step is one `.remote()` per rank and one bounded `ray.get`
over all of them (the ranks meet in their collectives: the agreement round and the model's
all-reduces). Ranks must produce the same outputs; rank 0's are returned.

    with local_ray(2), Instance(RankSettings(TinyWeights(), HiCacheConfig(page_size=16)),
                                tp_size=2) as inst:
        outs = inst.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))
"""
from __future__ import annotations

import logging
import time
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import placement_group, remove_placement_group

from kvtier.actors.rank_actor import RANK_NUM_CPUS, RankSettings, RankStats, create_rank_actor
from kvtier.engine.request import Output
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.tp_group import loopback_init_method
from kvtier.errors import ConfigError, KvtierError

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 120.0
STEP_TIMEOUT_S = 60.0
IDLE_WAIT_S = 0.0005


class InstanceError(KvtierError, RuntimeError):
    """A rank actor failed, timed out, or answered differently from rank 0."""


class Instance:
    """`tp_size` RankCache actors over one request stream; `generate` or `add_request`+`step`."""

    def __init__(self, settings: RankSettings, tp_size: int = 2,
                 num_cpus_per_rank: float = RANK_NUM_CPUS, strategy: str = "PACK",
                 ready_timeout_s: float = READY_TIMEOUT_S,
                 step_timeout_s: float = STEP_TIMEOUT_S,
                 resources: dict[str, float] | None = None) -> None:
        """`resources`: custom Ray resources each rank's bundle also asks for (e.g.
        `{"kvtier_instance": 1}`): the ranks land only on nodes that offer them."""
        if tp_size < 1:
            raise ConfigError(f"tp_size must be >= 1, got {tp_size}")
        settings.source.config()  # a bad source fails here, not inside every actor
        self.size, self.step_timeout_s = tp_size, step_timeout_s
        bundle = {"CPU": num_cpus_per_rank, **(resources or {})}
        self._pg = placement_group([dict(bundle) for _ in range(tp_size)], strategy=strategy)
        self.ranks: list[Any] = []
        try:
            self._get(self._pg.ready(), ready_timeout_s, "placing the rank bundles")
            init_method = loopback_init_method()
            self.ranks = [create_rank_actor(r, tp_size, init_method, settings, self._pg,
                                            num_cpus_per_rank) for r in range(tp_size)]
            self._get([a.has_unfinished.remote() for a in self.ranks], ready_timeout_s,
                      "starting the rank actors")
        except BaseException:
            self.close()
            raise
        self._done: dict[int, Output] = {}
        log.info("instance ready: TP=%d (%s)", tp_size, strategy)

    def _get(self, refs: Any, timeout_s: float, what: str) -> Any:
        try:
            return ray.get(refs, timeout=timeout_s)
        except GetTimeoutError as exc:
            raise InstanceError(f"{what} took over {timeout_s} s: a rank is stuck or the "
                                f"cluster lacks {self.size} bundles' CPUs; check `ray status`"
                                ) from exc
        except RayActorError as exc:
            raise InstanceError(f"a rank actor died while {what}: {exc}") from exc
        except RayTaskError as exc:  # a collective that timed out lands here too
            raise InstanceError(f"a rank failed while {what} (the instance is unusable now; "
                                f"close it and start another): {exc}") from exc

    def _all(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        refs = [getattr(a, method).remote(*args) for a in self.ranks]
        return self._get(refs, timeout_s or self.step_timeout_s, f"calling {method}")

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, tokens: Sequence[int], sampling: SamplingParams = SamplingParams()
                    ) -> int:
        ids = self._all("add_request", [int(t) for t in tokens], sampling)
        if len(set(ids)) != 1:
            raise InstanceError(f"ranks gave request ids {ids}: their streams are out of step")
        return ids[0]

    def step(self) -> list[Output]:
        """One lockstep step on every rank; rank 0's finished outputs (checked against all)."""
        per_rank = self._all("step")
        for rank, outs in enumerate(per_rank[1:], start=1):
            got = [(o.request_id, o.tokens, o.finish_reason) for o in outs]
            want = [(o.request_id, o.tokens, o.finish_reason) for o in per_rank[0]]
            if got != want:
                raise InstanceError(f"rank {rank} finished {got} but rank 0 {want}: the ranks "
                                    f"diverged (a bug in agreement); restart the instance")
        return per_rank[0]

    def abort(self, request_id: int) -> Output | None:
        return self._all("abort", request_id)[0]

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams = SamplingParams(), max_steps: int = 100_000
                 ) -> list[Output]:
        """Run token prompts to completion on all ranks; rank 0's outputs in prompt order."""
        ids = [self.add_request(p, sampling) for p in prompts]
        pending = set(ids)
        for _ in range(max_steps):
            if not pending:
                break
            outs = self.step()
            for out in outs:
                self._done[out.request_id] = out
                pending.discard(out.request_id)
            if not outs:
                time.sleep(IDLE_WAIT_S)
        else:
            raise InstanceError(f"requests {sorted(pending)} unfinished after {max_steps} "
                                f"steps; raise max_steps")
        return [self._done.pop(i) for i in ids]

    # ---- inspection and faults (tests, benchmarks) ------------------------------------------
    def stats(self) -> list[RankStats]:
        return self._all("stats")

    def quiesce(self) -> None:
        """Every rank waits for its queued L1<->L2 copies and L2->L3 backups."""
        self._all("quiesce")

    def evict_device(self) -> list[int]:
        """Flush L1 on every rank (pages backed up in L2 stay there); free L1 pages per rank."""
        return self._all("evict_device")

    def drop_cache(self) -> list[int]:
        """Evict every unlocked L1 and L2 page on every rank (L3 is untouched)."""
        return self._all("drop_cache")

    def rank_call(self, rank: int, method: str, *args: Any) -> Any:
        """Call one rank only (fault injection, per-rank cache surgery in tests)."""
        return self._get(getattr(self.ranks[rank], method).remote(*args), self.step_timeout_s,
                         f"calling {method} on rank {rank}")

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        if self.ranks:
            try:
                self._all("close", timeout_s=10.0)
            except InstanceError as exc:
                log.warning("closing the ranks: %s; killing them", exc)
            for actor in self.ranks:
                ray.kill(actor)
            self.ranks = []
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def __enter__(self) -> "Instance":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
