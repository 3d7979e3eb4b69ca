"""The connector's scheduler half and its L2 index, without vLLM: hits, plans, the MIN rule."""
from __future__ import annotations

import pytest

from kvtier.connector.l2_index import L2Index
from kvtier.connector.plan import WorkerReport
from kvtier.connector.scheduler_side import ScheduledRequest, SchedulerSide
from kvtier.keys import KeyNamespace

BS = 4
NS = KeyNamespace("m", layout_fingerprint="f")


def side(slots: int = 16, tp: int = 1) -> SchedulerSide:
    return SchedulerSide(NS, BS, slots, tp)


def run_prefill(s: SchedulerSide, req: str, tokens: list[int], blocks: list[int],
                ranks: int = 1, local: int = 0) -> tuple:
    """A request computed in one step from `local` tokens on; returns (plan, hit tokens)."""
    s.add(req)
    hit = s.match(req, tokens, local)
    s.allocated(req, blocks, hit)
    plan = s.plan([ScheduledRequest(req, tokens, blocks, len(tokens))])
    saved = frozenset(slot for save in plan.saves for slot in save.slots)
    s.settle(WorkerReport(ranks=ranks, saved=saved))
    return plan, hit


def test_saved_pages_hit_the_next_request_and_keep_one_token():
    s = side()
    tokens = list(range(100, 117))  # 17 tokens: 4 full pages
    plan, hit = run_prefill(s, "a", tokens, [10, 11, 12, 13, 14])
    assert hit == 0 and [save.blocks for save in plan.saves] == [(10, 11, 12, 13)]
    s.finish("a")
    plan, hit = run_prefill(s, "b", tokens, [20, 21, 22, 23, 24])
    assert hit == 16
    (load,) = plan.loads
    assert load.blocks == (20, 21, 22, 23) and plan.saves == ()
    # a prompt of exactly 16 tokens: the last page is recomputed, never loaded
    plan, hit = run_prefill(s, "c", tokens[:16], [30, 31, 32, 33])
    assert hit == 12 and plan.loads[0].blocks == (30, 31, 32)


def test_vllm_local_hit_is_skipped_and_salt_separates():
    s = side()
    tokens = list(range(17))
    run_prefill(s, "a", tokens, [1, 2, 3, 4, 5])
    s.add("b")
    assert s.match("b", tokens, local_tokens=8) == 8  # pages 2, 3 from L2
    s.allocated("b", [6, 7, 8, 9, 10], 8)
    assert s.plan([]).loads[0].blocks == (8, 9)
    s.add("salted", salt="tenant-x")
    assert s.match("salted", tokens, 0) == 0


def test_a_page_counts_only_when_every_rank_saved_it():
    s = side(tp=2)
    tokens = list(range(9))
    run_prefill(s, "a", tokens, [1, 2, 3], ranks=1)  # one rank's report: not held
    s.add("b")
    assert s.match("b", tokens, 0) == 0
    one = WorkerReport(saved=frozenset({5}))
    other = WorkerReport(saved=frozenset(), failed_saves=frozenset({5}))
    merged = one.merge(other)
    assert merged.ranks == 2 and merged.saved == frozenset() and 5 in merged.failed_saves


def test_generated_blocks_are_saved_as_they_fill():
    s = side()
    tokens = list(range(6))
    s.add("a")
    s.allocated("a", [1, 2], s.match("a", tokens, 0))
    assert s.plan([ScheduledRequest("a", tokens, [1, 2], 6)]).saves[0].blocks == (1,)
    tokens += [6, 7]  # two decode steps fill page 1
    assert s.plan([ScheduledRequest("a", tokens[:7], [1, 2], 7)]).saves == ()
    assert s.plan([ScheduledRequest("a", tokens, [1, 2], 8)]).saves[0].blocks == (2,)


def test_failed_load_forgets_the_page():
    s = side()
    tokens = list(range(9))
    run_prefill(s, "a", tokens, [1, 2, 3])
    s.add("b")
    assert s.match("b", tokens, 0) == 8
    slots = s.index.held_run(s._keys(s._requests["b"], tokens, 2))
    s.settle(WorkerReport(failed_loads=frozenset(slots[1:])))
    assert s.match("b", tokens, 0) == 4 and s.counts.failed_loads == 1


def test_index_evicts_least_recent_deepest_first_and_never_saving_pages():
    idx = L2Index(3)
    slots = idx.reserve(["a", "b", "c"])
    assert idx.reserve(["d"]) == []  # every slot is being saved
    idx.settle(slots, [])
    idx.touch(slots)  # a, b, c used together: c (the deepest) goes first
    (d,) = idx.reserve(["d"])
    assert d == slots[2] and "c" not in idx and idx.held_run(["a", "b"]) == slots[:2]
    with pytest.raises(ValueError):
        idx.reserve(["a"])
