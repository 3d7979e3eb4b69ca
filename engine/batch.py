"""What one forward computes: new tokens of one or more sequences and where their KV lives."""
from __future__ import annotations

from typing import Callable, NamedTuple, Sequence

import torch

from kvtier.errors import CacheUsageError


class SeqChunk(NamedTuple):
    """`num_tokens` new tokens at positions start_pos.. of one sequence.

    `page_table[i]` is the L1 page holding positions [i*page_size, (i+1)*page_size); it must
    cover every position up to start_pos + num_tokens. Positions before start_pos are read
    from the pool (computed earlier, or a cache hit); the new tokens' KV is written there.
    """

    page_table: Sequence[int]
    start_pos: int
    num_tokens: int

    @property
    def end_pos(self) -> int:
        return self.start_pos + self.num_tokens


class SlidingView(NamedTuple):
    """What a SLIDING layer reads of one sequence: keys [first_key, kv_len) of the pages whose
    sliding-window KV is in the pool's sidecar (older keys are out of every query's window)."""

    first_key: int            # a page boundary
    slots: torch.Tensor       # int64 sidecar slots of the pages covering [first_key, kv_len)
    mask: torch.Tensor | None  # (num_tokens, kv_len - first_key): causal and in the window


class SeqView(NamedTuple):
    """One sequence's share of a ForwardBatch, on the model's device."""

    rows: slice               # its rows among the batch's new tokens
    kv_len: int               # keys attention reads: positions [0, kv_len)
    pages: torch.Tensor       # int64 page ids covering [0, kv_len)
    mask: torch.Tensor | None  # (num_tokens, kv_len) bool, None when one token sees all keys
    sliding: SlidingView | None  # for SLIDING layers (None: the model has none)


SlotTable = Callable[[Sequence[int]], list[int]]


class ForwardBatch:
    """Index tensors built once per forward and shared by every layer."""

    def __init__(self, seqs: Sequence[SeqChunk], page_size: int, num_pages: int,
                 device: torch.device, sliding_window: int = 0,
                 slot_table: SlotTable | None = None) -> None:
        """`sliding_window` and `slot_table` (the pool sidecar's page -> slot map): a hybrid
        model's, whose SLIDING layers read and write the sidecar."""
        if not seqs:
            raise CacheUsageError("a forward needs at least one sequence")
        if bool(sliding_window) != (slot_table is not None):
            raise CacheUsageError("a sliding window needs the pool's sidecar slots, and slots "
                                  "a window; build the pool from model.kv_spec(page_size)")
        positions: list[int] = []
        slots: list[int] = []
        side_slots: list[int] = []
        views: list[SeqView] = []
        row = 0
        for seq in seqs:
            self._check(seq, page_size, num_pages)
            n_pages = -(-seq.end_pos // page_size)
            pos = range(seq.start_pos, seq.end_pos)
            positions.extend(pos)
            slots.extend(seq.page_table[p // page_size] * page_size + p % page_size for p in pos)
            pages = torch.tensor(list(seq.page_table[:n_pages]), dtype=torch.int64, device=device)
            sliding = None
            if slot_table is not None:
                sliding = _sliding_view(seq, page_size, sliding_window, slot_table, device)
                table = slot_table(seq.page_table[seq.start_pos // page_size:n_pages])
                first = seq.start_pos // page_size
                side_slots.extend(table[p // page_size - first] * page_size + p % page_size
                                  for p in pos)
            views.append(SeqView(slice(row, row + seq.num_tokens), seq.end_pos, pages,
                                 attention_mask(seq, device), sliding))
            row += seq.num_tokens
        self.seqs = tuple(seqs)
        self.views = tuple(views)
        self.num_tokens = row
        self.positions = torch.tensor(positions, dtype=torch.int64, device=device)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)
        # where the new tokens' sliding-window KV goes (None: no sliding layer)
        self.sliding_slots = (torch.tensor(side_slots, dtype=torch.int64, device=device)
                              if slot_table is not None else None)
        self.last_rows = torch.tensor([v.rows.stop - 1 for v in views], dtype=torch.int64,
                                      device=device)

    @staticmethod
    def _check(seq: SeqChunk, page_size: int, num_pages: int) -> None:
        if seq.num_tokens < 1 or seq.start_pos < 0:
            raise CacheUsageError(f"a sequence chunk needs start_pos >= 0 and num_tokens >= 1, "
                                  f"got start_pos={seq.start_pos}, num_tokens={seq.num_tokens}")
        needed = -(-seq.end_pos // page_size)
        if len(seq.page_table) < needed:
            raise CacheUsageError(f"page table has {len(seq.page_table)} pages but positions up "
                                  f"to {seq.end_pos} need {needed}; allocate pages first")
        bad = [p for p in seq.page_table[:needed] if not 0 <= p < num_pages]
        if bad:
            raise CacheUsageError(f"page ids {bad[:4]} are outside the pool's {num_pages} pages")


def _sliding_view(seq: SeqChunk, page_size: int, window: int, slot_table: SlotTable,
                  device: torch.device) -> SlidingView:
    first_page = max(0, seq.start_pos - window + 1) // page_size
    n_pages = -(-seq.end_pos // page_size)
    slots = torch.tensor(slot_table(seq.page_table[first_page:n_pages]), dtype=torch.int64,
                         device=device)
    mask = attention_mask(seq, device, window)
    first_key = first_page * page_size
    return SlidingView(first_key, slots, None if mask is None else mask[:, first_key:])


def attention_mask(seq: SeqChunk, device: torch.device, window: int = 0
                   ) -> torch.Tensor | None:
    """Query i (position q = start_pos+i) sees key k when k <= q (causal, offset by the
    prefix) and, with a `window`, q - k < window: a sliding layer masks keys `window` or
    more positions back. The one place that rule lives (prefill chunks and decode alike).
    None when every query sees every key (one new token, no key out of the window)."""
    last = seq.end_pos - 1
    if seq.num_tokens == 1 and not (window and last >= window):
        return None  # the one new token is the last key: it sees everything
    keys = torch.arange(seq.end_pos, device=device)
    queries = torch.arange(seq.start_pos, seq.end_pos, device=device)
    mask = keys[None, :] <= queries[:, None]
    if window:
        mask &= queries[:, None] - keys[None, :] < window
    return mask
