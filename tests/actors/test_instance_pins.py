"""Pins on a TP=2 instance on Ray over a file L3: every rank pins the same pages (the MIN of
what they hold, none when one rank lacks the prefix), the L3 namespace pins the pages the
ranks' backups published, and a hit in the ranks' L2 extends the L3 pin too (rank 0's step
tells the namespace actor; the pin reads tell no one)."""
from __future__ import annotations

import random
import time
import uuid
from types import SimpleNamespace

import pytest
import torch

from kvtier.actors.instance import Instance
from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
from kvtier.actors.pins import InstancePin, RankPinDesk, pin_on_instance
from kvtier.actors.rank_actor import RankSettings
from kvtier.config import HiCacheConfig
from kvtier.cli.demo import namespace_spec
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weight_sources import TinyWeights
from kvtier.messages import pack_record, unpack_record, unpack_records
from kvtier.tiers.cache_pins import PinListing, PinOutcome, PinRefusal

PAGE = 16
SOURCE = TinyWeights(seed=5)
CONFIG = HiCacheConfig(page_size=PAGE)
SETTINGS = RankSettings(SOURCE, CONFIG, device_pages=32, dtype=torch.float32,
                        chunk_tokens=4 * PAGE, timeout_s=60.0)
ONE = SamplingParams(max_new_tokens=1)
_rng = random.Random(3)
DOC = [_rng.randrange(1, 256) for _ in range(5 * PAGE)]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def setup(shared_ray, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pins")
    name = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    client = get_or_create_namespace_actor(name, str(tmp / "state"))
    inst = None
    try:
        spec = namespace_spec(SOURCE, CONFIG, "file", str(tmp / "l3"), "tiny",
                              f"t-{uuid.uuid4().hex[:6]}", dtype=torch.float32, page_size=PAGE,
                              tp_size=2)
        info = client.register(spec)
        inst = Instance(SETTINGS._replace(l3=info, l3_actor=name), tp_size=2,
                        num_cpus_per_rank=0.2)
        yield inst, client, info.namespace, spec.key_namespace.page_hashes(DOC, PAGE)
    finally:
        if inst is not None:
            inst.close()
        client.shutdown()


def pin(inst: Instance, ttl_s: float = 30.0) -> InstancePin:
    return pin_on_instance(inst, "i0", "p", DOC, "", ttl_s, 0.5, "")


def test_every_rank_pins_the_same_pages_or_none(setup):
    inst, client, ns, hashes = setup
    inst.generate([DOC + [1, 2, 3]], ONE)
    inst.quiesce()  # L3 backups done: nothing protects the L2 pages any more
    inst.on_rank(1, lambda a: a.drop_cache.remote())  # rank 1 lacks the prefix in L1 and L2
    assert pin(inst) == InstancePin("i0")
    assert inst.rank_group.pins() == [[], []]  # rank 0 holds it, yet pins nothing alone
    inst.generate([DOC + [4, 5]], ONE)  # both ranks hold it again
    out = pin(inst)
    assert out.pages == 5 and out.outcome.host_pages == 5, out
    per_rank = inst.rank_group.pins()
    assert [[(p.pin_id, p.pages, p.host_pages) for p in pins] for pins in per_rank] == \
        [[("p", 5, 5)]] * 2
    assert client.pin(ns, "p", hashes, 30.0, 0.5) == 5  # published: the backups were waited for
    inst.drop_cache()  # an operator's flush: pinned pages stay in L2
    assert inst.rank_group.pin_held(DOC, "") == [5, 5]


def test_an_l2_hit_extends_the_l3_pin(setup):
    inst, client, ns, _ = setup
    [before] = client.pins(ns)
    time.sleep(1.5)  # the L3 pin's clock runs on; only a hit can set it back
    out = inst.generate([DOC + [6]], ONE)[0]
    assert out.lengths.prefix_len + out.lengths.host_loaded_length == 5 * PAGE  # from L1/L2
    # rank 0's step told the namespace actor which pins the hit extended (no read needed)
    [after] = client.pins(ns)
    assert after.expires_in_s > before.expires_in_s - 0.75, (before, after)
    assert all(a.locked_nodes == a.protected_nodes == 0
               for a in inst.rank_group.audit())  # pins are neither locks nor leaks


class ScriptedRanks:
    """An Instance stand-in (no Ray): its rank group's answers to the pin calls, and the
    calls."""

    def __init__(self, held: list[int], pinned: list[PinOutcome | PinRefusal]) -> None:
        self.held, self.pinned = held, pinned
        self.calls: list[tuple] = []
        self.rank_group = self

    def pin_held(self, tokens: list[int], salt: str) -> list[int]:
        self.calls.append(("pin_held", tokens, salt))
        return self.held

    def pin(self, pin_id: str, tokens: list[int], pages: int, *rest) -> list:
        self.calls.append(("pin", pin_id, tokens, pages, *rest))
        return self.pinned

    def unpin(self, pin_id: str) -> list[bool]:
        self.calls.append(("unpin", pin_id))
        return [True] * len(self.held)

    def quiesce(self) -> None:
        self.calls.append(("quiesce",))


def test_the_min_of_the_ranks_is_pinned_and_one_refusal_unpins_every_rank():
    ok = PinOutcome("p", 3, 0, 3, 9.0)
    ranks = ScriptedRanks([5, 3], [ok, ok])
    out = pin_on_instance(ranks, "i0", "p", DOC, "", 9.0, 0.5, "")
    assert out == InstancePin("i0", PinOutcome("p", 3, 0, 3, 9.0))
    assert unpack_record(InstancePin, pack_record(out)) == out  # as its deployment sends it
    assert ranks.calls[1][:4] == ("pin", "p", DOC, 3)  # every rank pins the MIN: 3 pages
    assert ranks.calls[-1] == ("quiesce",)  # then the backups reach L3
    refusal = PinRefusal(3, 1, "over the share")
    ranks = ScriptedRanks([5, 5], [ok, refusal])
    out = pin_on_instance(ranks, "i0", "p", DOC, "", 9.0, 0.5, "")
    assert out == InstancePin("i0", refused=PinRefusal(3, 1, "over the share"))
    assert out.pages == 0 and unpack_record(InstancePin, pack_record(out)) == out
    assert ranks.calls[-1] == ("unpin", "p")  # the rank that pinned lets go too


class _Pins:
    """A rank cache's pins (tiers/cache_pins) as far as RankPinDesk uses them: one live pin, one
    past its TTL, one pin a hit extended; what was called."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def describe(self) -> list[PinListing]:
        return [PinListing("live", "", 1, 4.0, 1, 1), PinListing("lapsed", "", 1, 0.0, 0, 1)]

    def pinned_pages(self) -> tuple[int, int, int]:
        return 3, 1, 2

    def __len__(self) -> int:
        return 2

    def expire(self) -> list[str]:
        self.calls.append("expire")
        return ["lapsed"]

    def take_refreshed(self) -> list[str]:
        self.calls.append("take_refreshed")
        return ["live"]


def _rank_pins(rank: int) -> tuple[RankPinDesk, _Pins, list[tuple]]:
    pins, l3_calls = _Pins(), []
    cache = SimpleNamespace(pins=pins, extend_l3_pins=lambda ids: l3_calls.append(("ns", ids)))
    return RankPinDesk(cache, rank), pins, l3_calls  # type: ignore[arg-type]


def test_pin_reads_change_nothing_and_the_step_extends_l3_pins():
    rp, pins, l3_calls = _rank_pins(0)
    assert [p.pin_id for p in unpack_records(PinListing, rp.describe())] == ["live"]  # the
    # lapsed one is left out
    assert rp.figures() == {"pins": 2, "device_pages": 1, "host_pages": 2}
    assert pins.calls == [] and l3_calls == []  # reads: no expiry, no call to L3
    rp.refresh()  # the step's upkeep
    assert pins.calls == ["expire", "take_refreshed"] and l3_calls == [("ns", ["live"])]
    rp, pins, l3_calls = _rank_pins(1)
    rp.refresh()  # another rank drops its expired pins and forgets its hits: rank 0
    assert pins.calls == ["expire", "take_refreshed"] and l3_calls == []  # tells L3
