"""How one step's planned work is cut into forwards (default mode: batched prefill).

The scheduler plans, per prefilling request, a span of prompt positions [start, stop) under
the step's token budget, and a set of decoding sequences. `pack_forwards` turns that into
forwards of at most `max_tokens` new tokens each: the decodes ride in the first forward, then
the spans fill the forwards in plan order, each span cut where a forward is full and continued
in the next one. A request appears at most once per forward, and its pieces run in order, so
each piece reads the KV its earlier pieces wrote. The packing depends only on the plan, which
every TP rank shares, so every rank runs forwards of the same shapes.
"""
from __future__ import annotations

from typing import NamedTuple, Sequence, TypeVar

R = TypeVar("R")


class Piece(NamedTuple):
    """Prompt positions [start, stop) of one request, computed in one forward."""

    req: object
    start: int
    stop: int

    @property
    def num_tokens(self) -> int:
        return self.stop - self.start


class Forward(NamedTuple):
    """One model call: prefill pieces, then one token for each decoding sequence."""

    pieces: tuple[Piece, ...]
    decodes: tuple[object, ...]

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.pieces) + len(self.decodes)


def pack_forwards(spans: Sequence[Piece], decodes: Sequence[R],
                  max_tokens: int) -> list[Forward]:
    """The forwards that compute `spans` (one per request, in plan order) and `decodes`."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    todo = [s for s in spans if s.stop > s.start]
    forwards: list[Forward] = []
    riders = tuple(decodes)
    while todo or riders:
        room = max_tokens - len(riders)
        pieces, rest = [], []
        for span in todo:
            take = min(span.num_tokens, max(0, room))
            if take:
                pieces.append(Piece(span.req, span.start, span.start + take))
                room -= take
            if span.start + take < span.stop:
                rest.append(Piece(span.req, span.start + take, span.stop))
        forwards.append(Forward(tuple(pieces), riders))
        todo, riders = rest, ()
    return forwards
