"""Prefill/decode hand-off: a request's KV moves from the L1 pages a prefill rank computed
into the L1 pages a decode rank reserved for it, and each side can tell it arrived whole.

The protocol, one request at a time (each step visible in `HandoffStages`):
  bootstrap  the decode rank reserves one L1 page per prompt page (`HandoffDesk`) and
             answers with a `HandoffTarget`: where those pages are in its pool
  prefill    the prefill rank computes the prompt (reusing its cache) and samples the
             first token
  transfer   the prefill rank writes each prompt page, region by region (a page is 2 x
             layers runs of (page_size, heads, head_dim) in the pool), into the reserved
             pages over a `TransportEndpoint` (NIXL or Mooncake), then reports a
             `HandoffSent` with an xxh3 sum per page as it sent it
  KV-ready   the decode rank sums the pages it received (`PageExchange.l1_sums`); the decode ranks
             agree in their step's one MIN collective that every page landed and matched
             (kvtier.engine.admission), and the request starts decoding from its second
             token; on a mismatch any rank saw, every rank recomputes it instead
  decode     as any request; the prefill rank gives its request's pages to its own cache
             (prefix pages stay as cached prefixes) once the decode side is ready

Why the pages' addresses travel and not the bytes: the KV never passes through an actor's
arguments or Ray's object store; only these small records do (msgpack records: kvtier.messages
`pack_record`).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

from kvtier.errors import ConfigError
from kvtier.kv_spec import KVSpec
from kvtier.engine.sampling import TokenLogprob


class HandoffTarget(NamedTuple):
    """One decode rank's reservation for a request, as its prefill rank needs it."""

    handoff_id: str
    peer: bytes             # the decode rank's endpoint address (TransportEndpoint.address)
    base_addr: int          # its L1 pool's first byte
    pool_pages: int         # its L1 pool's page count (the pool's shape: where a page lies)
    pages: tuple[int, ...]  # the reserved L1 page ids, one per prompt page, in order
    write_by: float = 0.0   # wall-clock time after which the prefill rank must not write:
    # half the reservation's hold, so a late writer never touches pages the decode rank
    # freed at the hold's end and gave to another request (0: no deadline)
    heads: tuple[int, int] = (0, 0)  # the decode rank's KV heads [start, stop) of the model's
    staging: "Staging | None" = None  # different TP sizes: its L2 pages to write head objects to


class Staging(NamedTuple):
    """A decode rank's L2 staging pages (`page_head` layout), for prefill ranks of another
    TP size: they write whole head objects there (kvtier.tiers.page_exchange)."""

    base_addr: int
    pool_pages: int
    pages: tuple[int, ...]


class HandoffSent(NamedTuple):
    """What one prefill rank's transfer of one request did."""

    handoff_id: str
    ok: bool                 # every page written (False: the decode side must recompute)
    sums: tuple[int, ...]    # xxh3_64 of each page as sent (PageExchange.l1_sums)
    bytes: int
    descriptors: int
    seconds: float
    error: str = ""          # why not ok
    heads: tuple[int, int] = (0, 0)  # the prefill rank's KV heads [start, stop)
    staged: bool = False  # sums are per (page, head) of head objects, not per L1 page


class IncomingKV(NamedTuple):
    """A decode request's received prompt KV: its pages, what their sums must be, and what
    the prefill side sampled (its first token, and that token's log-probability when the
    request asked for them)."""

    handoff_id: str
    pages: tuple[int, ...]
    sums: tuple[int, ...]
    first_token: int
    first_logprob: TokenLogprob | None = None
    staged: tuple[int, ...] = ()  # different TP sizes: the L2 staging pages the head objects
    # were written to (sums then per page and head, in the rank's head order)


class HandoffStages(NamedTuple):
    """Seconds per stage of one PD request (None: the stage did not happen)."""

    bootstrap_s: float | None = None   # reserving the decode pages
    prefill_s: float | None = None     # prefill arrival to its first token
    transfer_s: float | None = None    # the slowest prefill rank's write
    kv_ready_s: float | None = None    # decode arrival to every decode rank agreeing
    decode_queue_s: float | None = None  # KV-ready to its first decoded token

    def to_dict(self) -> dict[str, float | None]:
        return self._asdict()


def rank_sums(target: HandoffTarget, sent: Sequence[HandoffSent]) -> tuple[int, ...]:
    """The sums one decode rank checks its received KV against: the page sums of the prefill
    rank with its heads (equal TP sizes), or, staged, its heads' object sums page by page
    then head, each from the prefill rank that holds the head. () when a rank's transfer is
    missing or failed: the check then fails and the request is recomputed."""
    for s in sent:
        if s.heads == target.heads and not s.staged:
            return s.sums if s.ok else ()
    if target.staging is None:
        return ()
    owners = []
    for head in range(*target.heads):
        owner = next((s for s in sent if s.staged and s.heads[0] <= head < s.heads[1]), None)
        if owner is None or not owner.ok:
            return ()
        owners.append((owner, head - owner.heads[0], owner.heads[1] - owner.heads[0]))
    return tuple(s.sums[page * width + index] for page in range(len(target.pages))
                 for s, index, width in owners)


def check_handoff_spec(spec: KVSpec) -> None:
    """A hybrid model's sliding-window KV lives in a sidecar no hand-off moves yet."""
    if spec.sliding is not None:
        raise ConfigError("prefill/decode hand-off moves full-attention KV only; a hybrid "
                          "model (sliding-window layers) must be served mixed")
