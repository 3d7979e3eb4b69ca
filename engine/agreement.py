"""Rank agreement: the one collective a scheduling step runs so that TP ranks never diverge.

Every rank of an instance runs the same scheduler on the same request stream, but each rank's
cache is its own: hits, allocations, L3 lookups and prefetch completions can differ. Once per
step each rank packs what it found locally into an `AgreementPayload`; `CollectiveAgreement`
reduces it elementwise over the TP group in ONE `all_reduce(MIN)` of an int64 tensor (MAX
fields ride in the same tensor negated, since max(x) == -min(-x)), and every rank acts on the
result. At TP=1 `local_agree` returns the payload as it is.

Why the shape cannot differ between ranks: the tensor has a fixed length per instance
(`slots` admission slots, padded), and a slot is a request of the step's window of the waiting
queue (kvtier.engine.admission_window), which is replicated state; what a rank found locally (a prefetch ticket or none, a failed lookup, no
room) changes values, never the shape. A header carries the number of waiting requests packed
and a hash of their ids, reduced both as MIN and as MAX: if the ranks' queues ever differ, the
same reduced tensor tells every rank at once (`AgreementError`), so they fail together instead
of hanging in a collective, and the instance rebuilds them.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Sequence

import torch
import torch.distributed as dist

from kvtier.engine.parallel import TensorParallel
from kvtier.engine.tp_group import rank_device
from kvtier.errors import KvtierError

log = logging.getLogger(__name__)

AGREEMENT_SLOTS = 32  # waiting requests considered per step (kvtier.engine.admission_window)
_FIELDS = 8  # per slot: usable, ok, need, loaded, ready, waiting, fetched, hit
NO_TICKET = 1 << 40  # `fetched` of a rank with no prefetch: never the MIN
_HEADER = 8  # count, -count, ids hash, -ids hash, -terminate, -decode_short,
#              -retract_failed, restore_ok


class AgreementError(KvtierError, RuntimeError):
    """The ranks packed different waiting queues: their schedulers are out of step."""


def ids_digest(ids: Sequence[int]) -> int:
    """A 62-bit digest of the ordered request ids a rank packed (negatable in int64)."""
    raw = hashlib.blake2b(b",".join(str(i).encode() for i in ids), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2


class RetractionVote(NamedTuple):
    """A rank's say on retraction (kvtier.engine.retraction), in the step's one round."""

    retract_failed: int = 0  # 1: this rank holds no L2 copy of a request retracted last step
    restore_ok: int = 0      # 1: this rank holds L1 pages, loaded, for the restore candidate


@dataclass(frozen=True)
class AgreementPayload:
    """One step's per-rank facts; after the reduce, what every rank acts on.

    Per admission slot i (the i-th waiting request, in queue order):
      usable[i]  MIN  prompt tokens the rank can reuse from its cache (chunk-grid aligned)
      ok[i]      MIN  SLOT_RESERVED (lookup + L1 pages held), SLOT_SKIPPED, SLOT_FAILED
      need[i]    MAX  the smallest usable prefix the rank's reservation can commit with
      loaded[i]  MAX  L2->L1 load-back tokens the rank's lookup started (budget accounting)
      ready[i]   MIN  1 when the rank has no L3 prefetch for it, or may finalize it now
      waiting[i] MAX  1 when the rank still holds an L3 prefetch ticket for it
      fetched[i] MIN  the prompt page its prefetch has landed up to on the rank (its start
                      page + pages landed; NO_TICKET: none): when the prefetch is finalized,
                      every rank with a ticket inserts L3 pages up to that page only
      hit[i]     MIN  tokens of its prompt the rank holds in L1 or L2 (a peek, no lock): the
                      next step orders the waiting queue by it (longest prefix first)
    Header:
      count      MIN and MAX  waiting requests packed (a difference: the queues differ)
      ids        MIN and MAX  `ids_digest` of their request ids
      terminate    MAX  1 when any rank asks the instance to stop (every request is aborted)
      decode_short MAX  1 when a rank could not give a decoding sequence its next page
      retract_failed MAX  1 when a rank could not keep an L2 copy of a request retracted
                   last step (every rank recomputes it instead)
      restore_ok   MIN  1 when a rank reserved L1 for this step's restore candidate and
                   loaded its KV there (a retracted request resumes only where all did)
    After a reduce, `count`/`ids` hold the MIN and `count_max`/`ids_max` the MAX.
    """

    usable: tuple[int, ...] = ()
    ok: tuple[int, ...] = ()
    need: tuple[int, ...] = ()
    loaded: tuple[int, ...] = ()
    ready: tuple[int, ...] = ()
    waiting: tuple[int, ...] = ()
    fetched: tuple[int, ...] = ()
    hit: tuple[int, ...] = ()
    count: int = 0
    ids: int = 0
    terminate: int = 0
    decode_short: int = 0
    retract_failed: int = 0
    restore_ok: int = 0
    count_max: int | None = None  # set by a reduce; None: this rank's own (= count)
    ids_max: int | None = None

    def __post_init__(self) -> None:
        n = len(self.usable)
        if not self.fetched and n:  # a payload without prefetches: nothing fetched anywhere
            object.__setattr__(self, "fetched", (NO_TICKET,) * n)
        if not self.hit and n:  # nobody looked: no hit known
            object.__setattr__(self, "hit", (0,) * n)
        lengths = [len(getattr(self, f))
                   for f in ("ok", "need", "loaded", "ready", "waiting", "fetched", "hit")]
        if any(k != n for k in lengths):
            raise AgreementError(f"admission fields have lengths {[n, *lengths]}; give one "
                                 "entry per slot in each")

    @property
    def vote(self) -> RetractionVote:
        return RetractionVote(self.retract_failed, self.restore_ok)

    @property
    def num_slots(self) -> int:
        return len(self.usable)

    @property
    def consistent(self) -> bool:
        """Every rank packed the same waiting queue (always true before a reduce)."""
        return ((self.count_max is None or self.count_max == self.count)
                and (self.ids_max is None or self.ids_max == self.ids))

    def committable(self, i: int) -> bool:
        """Slot i may be committed on every rank: none still waits for its prefetch, all
        reserved it, with a usable prefix every rank's reservation covers."""
        return (not self.waiting[i] and self.ok[i] == SLOT_RESERVED
                and self.usable[i] >= self.need[i])


# Admission slot states, ordered so that MIN gives the answer for all ranks: any rank that
# failed to allocate -> FAILED; else any rank that did not reach the slot -> SKIPPED.
SLOT_FAILED, SLOT_SKIPPED, SLOT_RESERVED = 0, 1, 2

Agree = Callable[[AgreementPayload], AgreementPayload]


def pack(p: AgreementPayload, slots: int = AGREEMENT_SLOTS) -> torch.Tensor:
    """The header, then `slots` slots of each field (padding: an empty, ready slot), int64."""
    if p.num_slots > slots:
        raise AgreementError(f"{p.num_slots} slots packed into a tensor of {slots}")
    pad = slots - p.num_slots
    values = [p.count, -p.count, p.ids, -p.ids, -p.terminate, -p.decode_short,
              -p.retract_failed, p.restore_ok]
    for field, sign, fill in (("usable", 1, 0), ("ok", 1, SLOT_SKIPPED), ("need", -1, 0),
                              ("loaded", -1, 0), ("ready", 1, 1), ("waiting", -1, 0),
                              ("fetched", 1, NO_TICKET), ("hit", 1, 0)):
        values += [sign * x for x in getattr(p, field)] + [sign * fill] * pad
    return torch.tensor(values, dtype=torch.int64)


def unpack(t: torch.Tensor, num_slots: int) -> AgreementPayload:
    """The first `num_slots` slots of a (reduced) tensor, with the header's MIN and MAX."""
    v = t.tolist()
    slots = (len(v) - _HEADER) // _FIELDS
    if len(v) != _HEADER + _FIELDS * slots or not 0 <= num_slots <= slots:
        raise AgreementError(f"an agreement tensor of {len(v)} values cannot hold {num_slots} "
                             "slots: the ranks packed different shapes")
    body = v[_HEADER:]
    cols = [body[k * slots:k * slots + num_slots] for k in range(_FIELDS)]
    usable, ok, need, loaded, ready, waiting, fetched, hit = cols
    return AgreementPayload(tuple(usable), tuple(ok), tuple(-x for x in need),
                            tuple(-x for x in loaded), tuple(ready), tuple(-x for x in waiting),
                            tuple(fetched), tuple(hit),
                            count=v[0], ids=v[2], terminate=-v[4], decode_short=-v[5],
                            retract_failed=-v[6], restore_ok=v[7],
                            count_max=-v[1], ids_max=-v[3])


def local_agree(payload: AgreementPayload) -> AgreementPayload:
    """TP=1: one rank agrees with itself."""
    return payload


class CollectiveAgreement:
    """`agree` over a TP group: one all_reduce(MIN) per call; counts rounds and time spent."""

    def __init__(self, tp: TensorParallel, slots: int = AGREEMENT_SLOTS) -> None:
        self.tp, self.slots = tp, slots
        self.rounds = 0
        self.total_s = 0.0
        self.times_s: deque[float] = deque(maxlen=4096)  # recent rounds, for p50/p99

    def __call__(self, payload: AgreementPayload) -> AgreementPayload:
        t = pack(payload, self.slots)
        if self.tp.size > 1:
            t = t.to(rank_device())  # NCCL reduces CUDA tensors only; gloo takes CPU ones
        start = time.perf_counter()
        if self.tp.size > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.tp.group)
        elapsed = time.perf_counter() - start
        self.rounds += 1
        self.total_s += elapsed
        self.times_s.append(elapsed)
        agreed = unpack(t.cpu(), payload.num_slots)
        if not agreed.consistent:  # every rank sees this same tensor: they all stop here
            raise AgreementError(
                f"rank {self.tp.rank} packed {payload.count} waiting requests, the ranks "
                f"between {agreed.count} and {agreed.count_max} (id digests "
                f"{'match' if agreed.ids == agreed.ids_max else 'differ'}): the schedulers "
                "are out of step; the instance rebuilds its ranks")
        return agreed
