"""Rank agreement: the one collective a scheduling step runs so that TP ranks never diverge.

Every rank of an instance runs the same scheduler on the same request stream, but each rank's
cache is its own: hits, allocations and prefetch completions can differ. Once per step each
rank packs what it found locally into an `AgreementPayload`; `CollectiveAgreement` reduces it
elementwise over the TP group in ONE `all_reduce(MIN)` of an int64 tensor (MAX fields ride
in the same tensor negated, since max(x) == -min(-x)), and every rank acts on the result.
At TP=1 `local_agree` returns the payload as it is.

Payload shape must match across ranks: slots are indexed by replicated state (the waiting
queue, in order), so every rank packs the same number of slots.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from kvtier.engine.parallel import TensorParallel
from kvtier.engine.tp_group import rank_device
from kvtier.errors import KvtierError

log = logging.getLogger(__name__)


class AgreementError(KvtierError, RuntimeError):
    """The ranks packed payloads of different shapes: their schedulers are out of step."""


@dataclass(frozen=True)
class AgreementPayload:
    """One step's per-rank facts; after the reduce, what every rank acts on.

    Per admission slot i (a waiting request this step considers, in queue order):
      usable[i]  MIN  prompt tokens the rank can reuse from its cache (chunk-grid aligned)
      ok[i]      MIN  SLOT_RESERVED (lookup + L1 pages held), SLOT_SKIPPED, SLOT_FAILED
      need[i]    MAX  the smallest usable prefix the rank's reservation can commit with
      loaded[i]  MAX  L2->L1 load-back tokens the rank's lookup started (budget accounting)
    Per prefetch slot j (a waiting request with an L3 prefetch in flight, in queue order):
      ready[j]   MIN  1 when the rank's prefetch may be finalized
    terminate    MAX  1 when any rank asks the instance to stop (every request is aborted)
    decode_short MAX  1 when a rank could not give a decoding sequence its next page
    """

    usable: tuple[int, ...] = ()
    ok: tuple[int, ...] = ()
    need: tuple[int, ...] = ()
    loaded: tuple[int, ...] = ()
    ready: tuple[int, ...] = ()
    terminate: int = 0
    decode_short: int = 0

    def __post_init__(self) -> None:
        n = len(self.usable)
        if not len(self.ok) == len(self.need) == len(self.loaded) == n:
            raise AgreementError(f"admission fields have lengths {len(self.usable)}, "
                                 f"{len(self.ok)}, {len(self.need)}, {len(self.loaded)}; "
                                 f"give one entry per slot in each")

    @property
    def num_slots(self) -> int:
        return len(self.usable)

    def committable(self, i: int) -> bool:
        """Slot i may be committed on every rank: all reserved it, with a usable prefix every
        rank's reservation covers."""
        return self.ok[i] == SLOT_RESERVED and self.usable[i] >= self.need[i]


# Admission slot states, ordered so that MIN gives the answer for all ranks: any rank that
# failed to allocate -> FAILED; else any rank that did not reach the slot -> SKIPPED.
SLOT_FAILED, SLOT_SKIPPED, SLOT_RESERVED = 0, 1, 2

Agree = Callable[[AgreementPayload], AgreementPayload]


def pack(p: AgreementPayload) -> torch.Tensor:
    """[n_slots, n_ready, usable.., ok.., -need.., -loaded.., ready.., -terminate,
    -decode_short] as int64.
    The two counts lead, so a MIN that changes them shows the ranks disagree on the shape."""
    values = [p.num_slots, len(p.ready), *p.usable, *p.ok, *(-x for x in p.need),
              *(-x for x in p.loaded), *p.ready, -p.terminate,
              -p.decode_short]
    return torch.tensor(values, dtype=torch.int64)


def unpack(t: torch.Tensor) -> AgreementPayload:
    v = t.tolist()
    n, r = v[0], v[1]
    body = v[2:]
    if len(body) != 4 * n + r + 2:
        raise AgreementError(f"an agreement tensor of {len(v)} values cannot hold {n} slots "
                             f"and {r} prefetch flags: the ranks packed different shapes")
    usable, ok = body[:n], body[n:2 * n]
    need, loaded = [-x for x in body[2 * n:3 * n]], [-x for x in body[3 * n:4 * n]]
    ready, terminate, short = body[4 * n:4 * n + r], -body[4 * n + r], -body[4 * n + r + 1]
    return AgreementPayload(tuple(usable), tuple(ok), tuple(need), tuple(loaded), tuple(ready),
                            terminate, short)


def local_agree(payload: AgreementPayload) -> AgreementPayload:
    """TP=1: one rank agrees with itself."""
    return payload


class CollectiveAgreement:
    """`agree` over a TP group: one all_reduce(MIN) per call; counts rounds and time spent."""

    def __init__(self, tp: TensorParallel) -> None:
        self.tp = tp
        self.rounds = 0
        self.total_s = 0.0
        self.times_s: deque[float] = deque(maxlen=4096)  # recent rounds, for p50/p99

    def __call__(self, payload: AgreementPayload) -> AgreementPayload:
        t = pack(payload)
        if self.tp.size > 1:
            t = t.to(rank_device())  # NCCL reduces CUDA tensors only; gloo takes CPU ones
        start = time.perf_counter()
        if self.tp.size > 1:
            before = t[:2].clone()
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
            if not torch.equal(before, t[:2]):
                raise AgreementError(f"rank {self.tp.rank} packed {before.tolist()} slots but "
                                     f"another rank fewer ({t[:2].tolist()}): the schedulers "
                                     f"are out of step; restart the instance")
        elapsed = time.perf_counter() - start
        self.rounds += 1
        self.total_s += elapsed
        self.times_s.append(elapsed)
        return unpack(t)
