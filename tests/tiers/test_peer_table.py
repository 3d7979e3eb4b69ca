"""The peer table (tiers/peer_table): a row per L2 page, found by chain key, each row checked so
that a row read while its owner rewrites it, or cleared, is never taken for a valid one."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from kvtier.tiers.peer_table import KEY_BYTES, PeerTable, VerifiedSums, lookup, row_dtype

HEADS = 3
KEYS = [hashlib.sha256(bytes([i])).hexdigest() for i in range(6)]


def read(table: PeerTable) -> np.ndarray:
    """The table's bytes, as a peer's read copies them."""
    return table.rows.view(np.uint8).copy()


def test_a_prefix_is_found_page_by_page_up_to_the_first_page_not_listed():
    table = PeerTable(8, HEADS)
    table.publish([5, 2, 7], KEYS[:3], list(range(9)))
    table.publish([0], KEYS[4:5], [9, 9, 9])  # a page further on: the run ends before it
    hit = lookup(read(table), HEADS, KEYS)
    assert hit.pages == (5, 2, 7) and hit.sums == tuple(range(9))
    assert lookup(read(table), HEADS, KEYS[1:2]).pages == (2,)
    assert lookup(read(table), HEADS, KEYS[3:]).pages == ()


def test_cleared_rows_and_an_empty_table_list_nothing():
    table = PeerTable(4, HEADS)
    assert lookup(read(table), HEADS, KEYS).pages == ()  # all zero is not a valid row
    table.publish([1, 3], KEYS[:2], [1] * 6)
    table.clear([3])
    assert lookup(read(table), HEADS, KEYS).pages == (1,)
    table.clear([1])
    assert not table.rows.view(np.uint64).any()


@pytest.mark.parametrize("byte", [0, KEY_BYTES - 1, KEY_BYTES, KEY_BYTES + 8 * HEADS - 1,
                                  KEY_BYTES + 8 * HEADS])
def test_a_row_torn_anywhere_is_not_valid(byte):
    """A row read half old, half new (a byte differs from what its check covers) is a miss."""
    table = PeerTable(4, HEADS)
    table.publish([2], KEYS[:1], [11, 12, 13])
    raw = read(table)
    raw[2 * row_dtype(HEADS).itemsize + byte] ^= 0x10
    assert lookup(raw, HEADS, KEYS[:1]).pages == ()


def test_a_row_whose_sums_changed_without_its_check_is_not_valid():
    table = PeerTable(4, HEADS)
    table.publish([2], KEYS[:1], [11, 12, 13])
    table.rows["sums"][2] = [21, 22, 23]  # the new sums, the old check: torn
    assert lookup(read(table), HEADS, KEYS[:1]).pages == ()
    table.publish([2], KEYS[:1], [21, 22, 23])
    assert lookup(read(table), HEADS, KEYS[:1]).sums == (21, 22, 23)


def test_publishing_mismatched_lists_is_refused():
    with pytest.raises(ValueError, match="do not match"):
        PeerTable(4, HEADS).publish([1, 2], KEYS[:2], [1, 2, 3])


def test_verified_sums_stand_in_for_summing_once_and_never_outlive_a_drop():
    kept = VerifiedSums()
    kept.put([4, 1], [41, 42, 43, 11, 12, 13], HEADS)
    summed: list[list[int]] = []

    def compute(pages):
        summed.append(pages)
        return [100 * p + h for p in pages for h in range(HEADS)]

    assert kept.sums([1, 2, 4], HEADS, compute) == (11, 12, 13, 200, 201, 202, 41, 42, 43)
    assert summed == [[2]] and len(kept) == 0
    assert kept.sums([1], HEADS, compute) == (100, 101, 102)  # each is taken once
    kept.put([3, 5], [1, 2, 3, 4, 5, 6], HEADS)
    kept.drop([3])
    assert kept.sums([3, 5], HEADS, compute) == (300, 301, 302, 4, 5, 6)
    kept.drop([7])  # nothing kept: nothing to do
    with pytest.raises(ValueError, match="2 sums for 1 pages of 3 heads"):
        kept.put([1], [1, 2], HEADS)
