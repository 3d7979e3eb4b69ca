"""The agreement payload: one int64 tensor of a fixed shape, MIN and MAX fields in one reduce,
and a header that tells every rank at once when their waiting queues differ."""
from __future__ import annotations

import pytest
import torch

from kvtier.engine.agreement import (AGREEMENT_SLOTS, NO_TICKET, SLOT_FAILED, SLOT_RESERVED,
                                     SLOT_SKIPPED, AgreementError, AgreementPayload, ids_digest,
                                     local_agree, pack, unpack)


def payload(usable, ok, need, loaded, ready, waiting, ids=(1, 2), **kw) -> AgreementPayload:
    return AgreementPayload(tuple(usable), tuple(ok), tuple(need), tuple(loaded), tuple(ready),
                            tuple(waiting), count=len(ids), ids=ids_digest(ids), **kw)


def reduce_min(*payloads: AgreementPayload, slots: int = AGREEMENT_SLOTS) -> AgreementPayload:
    """What all_reduce(MIN) computes over the ranks' packed tensors."""
    tensors = [pack(p, slots) for p in payloads]
    return unpack(torch.stack(tensors).min(dim=0).values, payloads[0].num_slots)


def test_min_and_max_fields_reduce_in_one_tensor():
    a = payload((32, 0), (SLOT_RESERVED, SLOT_SKIPPED), (0, 0), (16, 0), (1, 1), (0, 0))
    b = payload((16, 48), (SLOT_RESERVED, SLOT_FAILED), (16, 0), (0, 0), (1, 0), (0, 1),
                terminate=1)
    agreed = reduce_min(a, b)
    assert (agreed.usable, agreed.ok, agreed.need, agreed.loaded) == \
        ((16, 0), (SLOT_RESERVED, SLOT_FAILED), (16, 0), (16, 0))
    assert agreed.ready == (1, 0) and agreed.waiting == (0, 1) and agreed.terminate == 1
    assert agreed.consistent and agreed.committable(0) and not agreed.committable(1)
    assert local_agree(a) is a and a.consistent


def test_the_shape_is_fixed_whatever_each_rank_found():
    """A rank with a prefetch ticket and one without pack tensors of one length."""
    ticket = payload((0,), (SLOT_SKIPPED,), (0,), (0,), (0,), (1,), ids=(7,))
    none = payload((32,), (SLOT_RESERVED,), (0,), (0,), (1,), (0,), ids=(7,))
    empty = AgreementPayload()
    assert pack(ticket).shape == pack(none).shape == pack(empty).shape
    agreed = reduce_min(ticket, none)
    assert agreed.consistent and agreed.waiting == (1,) and not agreed.committable(0)


def test_different_queues_are_seen_by_every_rank_in_the_same_reduce():
    one = payload((16,), (SLOT_RESERVED,), (0,), (0,), (1,), (0,), ids=(3,))
    two = payload((16, 0), (SLOT_RESERVED, SLOT_SKIPPED), (0, 0), (0, 0), (1, 1), (0, 0),
                  ids=(3, 4))
    swapped = payload((16, 0), (SLOT_RESERVED, SLOT_SKIPPED), (0, 0), (0, 0), (1, 1), (0, 0),
                      ids=(4, 3))
    assert not reduce_min(one, two).consistent  # counts differ
    assert not reduce_min(two, swapped).consistent  # same count, other requests
    assert reduce_min(two, two).consistent


def test_padding_never_changes_the_answer_and_overflow_is_refused():
    a = payload((32,), (SLOT_RESERVED,), (0,), (0,), (1,), (0,), ids=(1,))
    assert reduce_min(a, a, slots=4) == reduce_min(a, a, slots=AGREEMENT_SLOTS)
    with pytest.raises(AgreementError, match="slots"):
        pack(payload((0,) * 3, (SLOT_SKIPPED,) * 3, (0,) * 3, (0,) * 3, (1,) * 3, (0,) * 3,
                     ids=(1, 2, 3)), slots=2)


def test_decode_shortage_on_one_rank_reaches_all():
    short = AgreementPayload(decode_short=1)
    assert reduce_min(short, AgreementPayload()).decode_short == 1


def test_every_rank_takes_the_pages_all_ranks_landed():
    """`fetched` is a MIN over the ranks that prefetch; a rank without a ticket never lowers
    it, and a slot nobody fetches for stays NO_TICKET."""
    landed_3 = payload((0, 0), (SLOT_SKIPPED,) * 2, (0, 0), (0, 0), (1, 1), (1, 0))
    landed_3 = AgreementPayload(**{**landed_3.__dict__, "fetched": (3, NO_TICKET)})
    no_ticket = payload((0, 0), (SLOT_SKIPPED,) * 2, (0, 0), (0, 0), (1, 1), (0, 0))
    landed_5 = AgreementPayload(**{**landed_3.__dict__, "fetched": (5, NO_TICKET)})
    agreed = reduce_min(landed_3, no_ticket, landed_5)
    assert agreed.fetched == (3, NO_TICKET) and agreed.waiting == (1, 0)


def test_retraction_vote_fails_if_any_rank_lacks_a_copy_and_restores_only_if_all_can():
    kept = AgreementPayload(retract_failed=0, restore_ok=1)
    lacking = AgreementPayload(retract_failed=1, restore_ok=0)
    assert reduce_min(kept, lacking).vote == (1, 0)
    assert reduce_min(kept, kept).vote == (0, 1)
