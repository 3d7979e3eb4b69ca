"""Hit-first admission (kvtier.connector.admission): the waiting request with the most cached
tokens goes first, and preempts only cold prefills that lose nothing to L2, only as many as
it needs, never one pushed back before."""
from __future__ import annotations

import itertools

from kvtier.connector.admission import (KEEP, Admission, RunningRequest, WaitingRequest, admit,
                                        blocks_for)

BS = 64
BUDGET = 512


def waiting(req_id: str, tokens: int, cached: int) -> WaitingRequest:
    return WaitingRequest(req_id, tokens, cached, blocks_for(tokens, BS))


_ids = itertools.count()


def block_ids(count: int) -> frozenset[int]:
    """`count` block ids no other request of the test has."""
    return frozenset(next(_ids) for _ in range(count))


def cold(req_id: str, prompt: int = 1100, computed: int = 512, saved: int | None = None,
         blocks: int = 18, preempted: bool = False, can_free: bool = True,
         freeable: frozenset[int] | None = None) -> RunningRequest:
    return RunningRequest(req_id, prompt, computed, computed if saved is None else saved,
                          block_ids(blocks) if freeable is None else freeable, preempted,
                          can_free)


def decoding(req_id: str, blocks: int = 18) -> RunningRequest:
    return RunningRequest(req_id, 1100, 1110, 0, block_ids(blocks), False)


def test_no_hit_keeps_vllms_order():
    assert admit([waiting("a", 1100, 0), waiting("b", 1100, 64)], [cold("c")], 0, BUDGET,
                 BS) == KEEP
    assert admit([], [cold("c")], 0, BUDGET, BS) == KEEP


def test_the_longest_hit_goes_first_without_preempting_when_it_fits():
    queue = [waiting("cold", 1100, 0), waiting("short", 1200, 640), waiting("long", 1200, 1152),
             waiting("tie", 1200, 1152)]
    assert admit(queue, [decoding("d")], 40, BUDGET, BS) == Admission("long", ())


def test_a_hit_preempts_the_cold_prefill_with_least_progress_for_blocks():
    running = [decoding("b"), cold("c", computed=512), cold("e", computed=64)]
    queue = [waiting("cold", 1100, 0), waiting("hit", 1200, 1152)]
    # 2 blocks free, the hit needs 19; a budget that fits every chunk: blocks decide
    assert admit(queue, running, 2, 4096, BS) == Admission("hit", ("e",))
    # a 512-token budget: c's chunk would leave none for the hit, so c goes too
    assert admit(queue, running, 2, BUDGET, BS) == Admission("hit", ("e", "c"))


def test_a_hit_preempts_for_token_budget_too():
    # blocks are free, but c's next chunk takes the whole budget
    got = admit([waiting("hit", 1200, 1152)], [decoding("b"), cold("c", computed=0)], 40,
                BUDGET, BS)
    assert got == Admission("hit", ("c",))
    # a budget that leaves room for the hit's 48 tokens: nothing preempted
    assert admit([waiting("hit", 1200, 1152)], [cold("c", computed=0)], 40, 2048, BS) == \
        Admission("hit", ())


def test_what_is_never_preempted():
    hit = [waiting("hit", 1200, 1152)]
    unsaved = cold("c", computed=512, saved=448)  # L2 lacks a page it computed
    assert admit(hit, [unsaved], 0, BUDGET, BS) == Admission("hit", ())
    assert admit(hit, [cold("c", preempted=True)], 0, BUDGET, BS) == Admission("hit", ())
    assert admit(hit, [cold("c", can_free=False)], 0, BUDGET, BS) == Admission("hit", ())
    assert admit(hit, [decoding("d")], 0, BUDGET, BS) == Admission("hit", ())
    # a prefill with less left to compute than the hit's own tokens finishes first
    short = cold("c", prompt=1100, computed=1088)
    assert admit([waiting("hit", 2000, 1024)], [short], 0, BUDGET, BS) == Admission("hit", ())


def test_nothing_is_preempted_for_a_hit_that_would_not_fit_anyway():
    got = admit([waiting("hit", 2400, 2304)], [cold("c", blocks=10)], 0, BUDGET, BS)
    assert got == Admission("hit", ())


def test_partial_pages_do_not_count_as_lost():
    # 600 computed: 9 full pages (576 tokens) in L2, the partial one is recomputed anyway
    got = admit([waiting("hit", 1200, 1152)], [cold("c", computed=600, saved=576, blocks=20)],
                0, BUDGET,
                BS)
    assert got == Admission("hit", ("c",))


def test_a_request_waiting_too_long_goes_first_even_after_a_hit_was_put_first():
    queue, running = [waiting("hit", 1200, 1152), waiting("cold", 1100, 0)], [cold("c")]
    assert admit(queue, running, 2, BUDGET, BS, oldest_wait_steps=127,
                 max_wait_steps=128, oldest="cold") == Admission("hit", ("c",))
    # the hit stands first in the queue since the last step: aging puts the oldest before it
    assert admit(queue, running, 0, BUDGET, BS, oldest_wait_steps=128,
                 max_wait_steps=128, oldest="cold") == Admission("cold", ())


def test_a_block_the_victim_and_the_hit_share_is_not_counted_as_freed():
    """The hit's cached prefix sits in 12 blocks only the victim holds (vLLM's prefix cache
    shares them): preempting the victim frees them, and the hit takes them back, so they
    are not room for the hit's other blocks. Counted once, the victim frees 6 usable blocks,
    too few for the hit's 7 others: nothing is preempted for nothing."""
    shared = block_ids(12)
    victim = cold("c", freeable=shared | block_ids(6))
    hit = WaitingRequest("hit", 1200, 768, blocks_for(1200, BS) - 12, shared)
    assert admit([hit], [victim], 0, BUDGET, BS) == Admission("hit", ())
    roomy = cold("c", freeable=shared | block_ids(8))  # 8 usable: enough with 2 free
    assert admit([hit], [roomy], 2, BUDGET, BS) == Admission("hit", ("c",))
