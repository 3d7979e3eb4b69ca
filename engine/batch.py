"""What one forward computes: new tokens of one or more sequences and where their KV lives."""
from __future__ import annotations

from typing import AbstractSet, Callable, NamedTuple, Sequence

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


class KeySpan(NamedTuple):
    """The keys one layer kind's attention reads for a sequence: positions [first, end)."""

    first: int                # a page boundary
    pages: torch.Tensor       # int64 page ids covering [first, end)
    length: int               # end - first
    mask: torch.Tensor | None  # (num_tokens, length) bool, None when every query sees every key


class SeqView(NamedTuple):
    """One sequence's share of a ForwardBatch, on the model's device."""

    rows: slice               # its rows among the batch's new tokens
    full: KeySpan             # FULL layers: every key, [0, end_pos)
    window: KeySpan           # SLIDING layers: from the page of the chunk's window_start on
    #                           (pages are the pool sidecar's slots when it has one)


SlotTable = Callable[[Sequence[int]], list[int]]


class ForwardBatch:
    """Index tensors built once per forward and shared by every layer."""

    def __init__(self, seqs: Sequence[SeqChunk], page_size: int, num_pages: int,
                 device: torch.device, sliding_window: int = 0,
                 slot_table: SlotTable | None = None) -> None:
        """`slot_table` (the pool sidecar's page -> slot map): a hybrid model's SLIDING layers
        read and write their window in the sidecar (`sliding_slots`, the window spans)."""
        if not seqs:
            raise CacheUsageError("a forward needs at least one sequence")
        if slot_table is not None and not sliding_window:
            raise CacheUsageError("sidecar slots without a sliding window: the model has no "
                                  "sliding layer; build the pool from model.kv_spec(page_size)")
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
            full = KeySpan(0, pages, seq.end_pos, attention_mask(seq, device))
            window = (_window_span(seq, pages, page_size, sliding_window, device, slot_table)
                      if sliding_window else full)
            if slot_table is not None:  # where the new tokens' sliding KV goes
                first = window.first // page_size
                table = window.pages.tolist()
                side_slots.extend(table[p // page_size - first] * page_size + p % page_size
                                  for p in pos)
            views.append(SeqView(slice(row, row + seq.num_tokens), full, window))
            row += seq.num_tokens
        self.seqs = tuple(seqs)
        self.views = tuple(views)
        self.num_tokens = row
        self.positions = torch.tensor(positions, dtype=torch.int64, device=device)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=device)
        self.sliding_slots = (torch.tensor(side_slots, dtype=torch.int64, device=device)
                              if slot_table is not None else None)
        self.last_rows = torch.tensor([v.rows.stop - 1 for v in views], dtype=torch.int64,
                                      device=device)

    def rows_reading(self, pages: AbstractSet[int] | None) -> list[slice]:
        """The rows of the sequences whose page tables hold any of `pages`."""
        if not pages:
            return []
        return [view.rows for seq, view in zip(self.seqs, self.views)
                if not pages.isdisjoint(seq.page_table)]

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


def _window_span(seq: SeqChunk, pages: torch.Tensor, page_size: int, window: int,
                 device: torch.device, slot_table: SlotTable | None = None) -> KeySpan:
    """A sliding layer reads only the pages its queries' windows reach (whole pages: the mask
    hides the keys before each query's window); with a sidecar, their slots there."""
    first_page = window_start(seq.start_pos, window) // page_size
    first = first_page * page_size
    mask = attention_mask(seq, device, window)
    if mask is not None:
        mask = mask[:, first:]
    span = pages[first_page:]
    if slot_table is not None:
        n_pages = -(-seq.end_pos // page_size)
        span = torch.tensor(slot_table(seq.page_table[first_page:n_pages]), dtype=torch.int64,
                            device=device)
    return KeySpan(first, span, seq.end_pos - first, mask)


def window_start(position: int, window: int) -> int:
    """The oldest key a query at `position` sees in a SLIDING layer of `window`: a sequence
    whose next query sits there never reads that layer's keys before it again."""
    return max(0, position - window + 1)


def attention_mask(seq: SeqChunk, device: torch.device, window: int = 0
                   ) -> torch.Tensor | None:
    """Query i (position q = start_pos+i) sees key k when k <= q (causal, offset by the
    prefix) and, with a `window`, q - k < window: a sliding layer masks keys `window` or
    more positions back. The one place that rule lives (prefill chunks and decode alike).
    None when every query sees every key (one new token, no key out of the window)."""
    if seq.num_tokens == 1 and not (window and window_start(seq.start_pos, window) > 0):
        return None  # the one new token is the last key: it sees everything
    keys = torch.arange(seq.end_pos, device=device)
    queries = torch.arange(seq.start_pos, seq.end_pos, device=device)
    mask = keys[None, :] <= queries[:, None]
    if window:
        mask &= queries[:, None] - keys[None, :] < window
    return mask
