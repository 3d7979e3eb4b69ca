"""The admission window over a long waiting queue: the head in queue order, the other slots in
turn over everything behind it, the same choice wherever the same queues are seen."""
from __future__ import annotations

import math

import pytest

from kvtier.engine.admission_window import AdmissionWindow
from kvtier.engine.request import Request
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError


def queue(ids) -> list[Request]:
    return [Request(i, (1, 2, 3), SamplingParams()) for i in ids]


def ids(reqs) -> list[int]:
    return [r.id for r in reqs]


def test_a_queue_that_fits_is_taken_whole_in_its_order():
    window = AdmissionWindow(slots=8, head=4)
    waiting = queue([5, 3, 9, 1])
    assert ids(window.select(waiting)) == [5, 3, 9, 1]
    assert window.select([]) == []


def test_every_request_behind_the_head_takes_a_slot_in_turn():
    window = AdmissionWindow(slots=8, head=3)
    waiting = queue(range(50))
    rounds = math.ceil((50 - 3) / 5)
    seen: set[int] = set()
    for _ in range(rounds):
        chosen = ids(window.select(waiting))
        assert len(chosen) == 8 and chosen[:3] == [0, 1, 2]  # the head, every step
        assert chosen == sorted(chosen, key=[r.id for r in waiting].index)  # queue order
        seen.update(chosen)
    assert seen == set(range(50))


def test_the_rotation_follows_a_reordered_queue_and_newcomers_wait_their_turn():
    window = AdmissionWindow(slots=4, head=1)
    waiting = queue(range(10))
    assert ids(window.select(waiting)) == [0, 1, 2, 3]
    assert ids(window.select(waiting)) == [0, 4, 5, 6]
    waiting = waiting[::-1] + queue([10, 11])  # lpm moved things; two requests arrived
    # Head: 9. Behind it 8 and 7 never took a slot; then 3, 2 and 1 took theirs longest ago.
    assert ids(window.select(waiting)) == [9, 8, 7, 3]
    assert ids(window.select(waiting)) == [9, 6, 2, 1]
    assert ids(window.select(waiting)) == [9, 5, 4, 0]
    # The newcomers count from the step before they came: before 8, 7 and 3 took theirs.
    assert ids(window.select(waiting)) == [9, 8, 10, 11]


def test_a_request_that_leaves_and_comes_back_counts_from_its_return():
    window = AdmissionWindow(slots=3, head=1)
    waiting = queue(range(6))
    assert ids(window.select(waiting)) == [0, 1, 2]
    assert ids(window.select(waiting[:1] + waiting[2:])) == [0, 3, 4]  # 1 was admitted
    assert ids(window.select(waiting)) == [0, 2, 5]  # 1 is back (preempted): newest
    assert ids(window.select(waiting)) == [0, 1, 3]


def test_windows_fed_the_same_queues_agree():
    """What keeps TP ranks' windows equal: the choice is a function of the queues seen."""
    a, b = AdmissionWindow(slots=6, head=2), AdmissionWindow(slots=6, head=2)
    waiting = queue(range(40))
    for step in range(30):
        waiting = waiting[1:] + queue([100 + step]) if step % 3 else waiting[::-1]
        assert ids(a.select(waiting)) == ids(b.select(waiting))


@pytest.mark.parametrize("head", [0, 8, 9])
def test_the_head_leaves_room_to_rotate(head):
    with pytest.raises(ConfigError, match="head of 1 to 7"):
        AdmissionWindow(slots=8, head=head)
