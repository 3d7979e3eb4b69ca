"""Prefill/decode disaggregation on Ray: rank actors of a prefill instance write the prompt's
KV into a decode instance's reserved L1 pages over a real transport (NIXL UCX on loopback);
answers equal a mixed instance's at TP 1 and 2; faults lose nothing and leak nothing."""
from __future__ import annotations

import random
import time

import pytest
import torch
from eventually import eventually
from faulty_rank import FaultyRank

from kvtier.actors.instance import InstanceStep
from kvtier.actors.pd.driver import PDDriver, PDMode
from kvtier.actors.rank_actor import RankSettings
from kvtier.config import HiCacheConfig
from kvtier.engine.handoff import HandoffSent, HandoffTarget
from kvtier.engine.request import CachedTokens, FinishReason, Output, pages_for
from kvtier.engine.sampling import SamplingParams
from kvtier.engine.weight_sources import TinyWeights
from kvtier.tiers.cache_types import RequestLengths

PAGE = 16
SETTINGS = RankSettings(TinyWeights(seed=3), HiCacheConfig(page_size=PAGE), device_pages=48,
                        dtype=torch.float32, timeout_s=30.0)
GREEDY = SamplingParams(max_new_tokens=6)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


PROMPTS = [tokens(1, 70), tokens(2, 48), tokens(3, 9)]


@pytest.fixture(scope="module")
def mixed_answers(instance_factory):
    with instance_factory(SETTINGS, tp_size=1) as inst:
        return [o.tokens for o in inst.generate(PROMPTS, GREEDY)]


LINGER_S = 0.3  # failed writes' pages stay held this long in these tests
TIMED_OUT_LINGER_S = 15.0  # ... in the one that checks they are held (under LINGER_S + 30)
HOLD_S = 0.2  # a reservation's hold where a test lets it run out


def _held(*instances) -> list:
    """Whatever is held outside the caches' trees: rank audits, hand-off counters."""
    audits = [a for inst in instances for a in inst.rank_group.audit() if any(a)]
    return audits + [c for inst in instances for c in inst.handoff_counters()
                     if c.reserved_pages or c.handed_requests or c.sent_unreleased] \
        + [f"{inst.handed_requests} handed-off requests" for inst in instances
           if inst.handed_requests]


def _no_leaks(*instances, settle: bool = False) -> None:
    """Nothing held outside the caches' trees; `settle`: once the pages a failed write
    targeted were let go (after their linger, at a step)."""
    if settle:
        def stepped_clean() -> bool:
            for inst in instances:
                inst.step()
            return not _held(*instances)

        eventually(stepped_clean, LINGER_S + 30, "the pages a failed write targeted were let "
                   "go after their linger", interval_s=0.05)
    assert not _held(*instances), _held(*instances)


def _answered_once(pd: PDDriver, ids: list[int], max_steps: int = 2000) -> dict:
    """Step until nothing is in flight; each request's output by id (each came once)."""
    got: dict = {}
    for _ in range(max_steps):
        if not pd.num_pending:
            break
        for out in pd.step():
            assert out.request_id not in got, f"request {out.request_id} answered twice"
            got[out.request_id] = out
        time.sleep(0.001)
    assert sorted(got) == sorted(ids) and not pd.num_pending
    return got


@pytest.mark.parametrize("transport, prefill_tp, decode_tp", [
    ("nixl", 1, 1), ("nixl", 2, 2), ("nixl", 1, 2), ("nixl", 2, 1),
    ("mooncake", 1, 1), ("mooncake", 2, 1)])
def test_pd_answers_equal_mixed_and_bytes_go_through_the_transport(
        instance_factory, mixed_answers, transport, prefill_tp, decode_tp):
    """Equal TP sizes: L1 pages to L1 pages. Different ones: staged through L2, each prefill
    rank writing its heads' objects to the decode ranks that hold those heads."""
    with instance_factory(SETTINGS, tp_size=prefill_tp) as p, \
            instance_factory(SETTINGS, tp_size=decode_tp) as d:
        pd = PDDriver([p], [d], transport=transport)
        assert pd.staged is (prefill_tp != decode_tp)
        outs = pd.generate(PROMPTS, GREEDY)
        assert [o.tokens for o in outs] == mixed_answers
        assert [o.mode for o in outs] == [PDMode.HANDOFF] * len(PROMPTS)
        for o in outs:
            assert o.stages.transfer_s is not None and o.stages.kv_ready_s is not None
            assert o.ttft_s is not None and o.ttft_s > 0
        # Every KV byte went through NIXL: each prefill rank wrote exactly its heads' share
        # of every prompt page, and the decode ranks adopted every page they verified.
        page_bytes = d.describe().page_bytes  # over every KV head
        pages = sum(pages_for(len(t), PAGE) for t in PROMPTS)
        for c in p.handoff_counters():  # each prefill rank moved its heads' share, no more
            assert c.transport.value == transport
            assert c.transfers.bytes == pages * page_bytes // prefill_tp
        for c in d.handoff_counters():
            assert c.intake.adopted == len(PROMPTS)
        assert sum(o.transfer_bytes for o in outs) == pages * page_bytes
        # ...and none through Ray: no step report of either side carried even one page
        for c in p.handoff_counters() + d.handoff_counters():
            assert 0 < c.max_report_bytes < page_bytes // max(prefill_tp, decode_tp)
        _no_leaks(p, d)


def test_corrupt_page_on_one_rank_makes_every_rank_recompute(instance_factory, mixed_answers):
    """TP=2: rank 1 of the decode instance receives a damaged page; the KV-ready MIN makes
    both ranks recompute, and the answer is still the mixed one."""
    with instance_factory(SETTINGS, tp_size=2) as p, \
            instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as d:
        p.handoff_open("nixl"), d.handoff_open("nixl")
        prompt = PROMPTS[0]
        targets = d.reserve_handoff("corrupt", len(prompt))
        pid = p.add_prefill(prompt, SamplingParams(max_new_tokens=1), targets)
        sent = None
        for _ in range(200):
            step = p.step_report()
            if step.finished:
                first, sent = step.finished[0].tokens[0], step.handoffs[pid]
                break
        assert sent is not None and all(s.ok for s in sent)
        d.on_rank(1, lambda a: a.corrupt_l1_page.remote(targets[1].pages[1]))
        did = d.add_received(prompt, GREEDY, sent, targets, first)
        (out,) = d.wait([did])
        assert p.release_handoff(pid)
        assert out.tokens == mixed_answers[0]
        counters = d.handoff_counters()
        assert [c.intake.recomputed for c in counters] == [1, 1]
        assert [c.intake.pages_corrupt for c in counters] == [0, 1]
        _no_leaks(p, d)


def test_decode_rank_dies_before_kv_ready(instance_factory, mixed_answers):
    """The decode instance's rank dies after the transfer, before KV-ready: its ranks are
    replaced and the request recomputed there; nothing is lost or leaked."""
    with instance_factory(SETTINGS, tp_size=2) as p, \
            instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as d:
        pd = PDDriver([p], [d], transport="nixl")
        # at its next step: the one that would adopt the KV
        d.on_rank(1, lambda a: a.crash_after.remote(0))
        outs = pd.generate(PROMPTS[:2], GREEDY)
        assert [o.tokens for o in outs] == mixed_answers[:2]
        assert [o.mode for o in outs] == [PDMode.RECOMPUTED] * 2
        assert d.restarts == 1
        _no_leaks(p, d)


def test_prefill_rank_dies_and_the_request_is_retried(instance_factory, mixed_answers):
    """The prefill instance's rank dies with the request in flight: its ranks are replaced
    and the prefill runs again into the same reserved pages."""
    with instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as p, \
            instance_factory(SETTINGS, tp_size=2) as d:
        pd = PDDriver([p], [d], transport="nixl")
        p.on_rank(0, lambda a: a.crash_after.remote(0))
        outs = pd.generate(PROMPTS[:2], GREEDY)
        assert [o.tokens for o in outs] == mixed_answers[:2]
        assert [o.mode for o in outs] == [PDMode.HANDOFF] * 2
        assert p.restarts == 1
        _no_leaks(p, d)


def test_prefill_past_its_write_deadline_leaves_the_decode_side_to_recompute(
        instance_factory, mixed_answers):
    """A prefill that finishes after its write deadline (it restarted too late) writes
    nothing: the decode instance recomputes, and its reservation is freed."""
    with instance_factory(SETTINGS, tp_size=1) as p, instance_factory(SETTINGS, tp_size=1) as d:
        pd = PDDriver([p], [d], transport="nixl", hold_s=HOLD_S, linger_s=LINGER_S)
        rid = pd.add(PROMPTS[0], GREEDY)
        time.sleep(HOLD_S + 0.1)  # past write_by (hold/2) and the hold itself, before any step
        outs = []
        for _ in range(500):
            outs += pd.step()
            if outs:
                break
        assert outs[0].request_id == rid and outs[0].mode is PDMode.RECOMPUTED
        assert outs[0].tokens == mixed_answers[0]
        assert p.handoff_counters()[0].transfers.bytes == 0
        _no_leaks(p, d, settle=True)


def test_no_room_on_decode_serves_mixed(instance_factory, mixed_answers):
    small = SETTINGS._replace(device_pages=4)  # 64 tokens: the 70-token prompt cannot fit
    with instance_factory(SETTINGS, tp_size=1) as p, instance_factory(small, tp_size=1) as d:
        pd = PDDriver([p], [d], transport="nixl")
        (out,) = pd.generate(PROMPTS[:1], GREEDY)
        assert out.mode is PDMode.MIXED and out.tokens == mixed_answers[0]
        _no_leaks(p, d)


def test_decode_side_writes_the_finished_conversation_to_l3_for_the_next_turn(
        shared_ray, tmp_path, mixed_answers):
    """Both instances on one L3 namespace: the decode instance stores the conversation it
    finished (prompt and answer pages) in L3, so the next turn's prefill, on the prefill
    instance that never saw the answer, takes those pages from L3."""
    import uuid

    from kvtier.actors.instance import Instance
    from kvtier.actors.l3.namespace_actor import get_or_create_namespace_actor
    from kvtier.cli.demo import namespace_spec

    name = f"kvtier-test-{uuid.uuid4().hex[:8]}"
    client = get_or_create_namespace_actor(name, str(tmp_path / "state"))
    made = []
    try:
        config = HiCacheConfig(page_size=PAGE, prefetch_policy="wait_complete",
                               prefetch_threshold_tokens=PAGE, load_back_threshold_tokens=PAGE)
        spec = namespace_spec(SETTINGS.source, config, "file", str(tmp_path / "l3"),
                              "tiny", f"t-{uuid.uuid4().hex[:6]}", dtype=torch.float32,
                              page_size=PAGE)
        info = client.register(spec)
        settings = SETTINGS._replace(config=config, l3=info, l3_actor=name)
        p, d = (Instance(settings, tp_size=1, ready_timeout_s=90.0, step_timeout_s=30.0)
                for _ in range(2))
        made = [p, d]
        pd = PDDriver([p], [d], transport="nixl")
        first = tokens(5, 40)
        answer = SamplingParams(max_new_tokens=40)
        (turn1,) = pd.generate([first], answer)
        assert turn1.mode is PDMode.HANDOFF
        d.quiesce()  # the decode instance's backups of the conversation have landed
        turn2 = first + list(turn1.tokens) + tokens(6, 10)
        (out,) = pd.generate([turn2], GREEDY)
        # The prefill side held the first prompt's pages only; the answer's came from L3.
        assert out.cached.storage >= PAGE * ((len(first) + 39) // PAGE - len(first) // PAGE)
        with Instance(SETTINGS, tp_size=1) as mixed:
            assert out.tokens == mixed.generate([turn2], GREEDY)[0].tokens
    finally:
        for inst in made:
            inst.close()
        client.shutdown()


def test_decode_instance_short_of_l1_retracts_to_l2_and_restores(instance_factory):
    """Three hand-offs whose answers outgrow the decode instance's L1: it retracts requests
    to L2 and restores them (no token recomputed), and the answers are the mixed ones."""
    long = SamplingParams(max_new_tokens=40)
    with instance_factory(SETTINGS, tp_size=1) as mixed:
        want = [o.tokens for o in mixed.generate(PROMPTS, long)]
    small = SETTINGS._replace(device_pages=12)  # the prompts fit (9 pages), the answers not
    with instance_factory(SETTINGS, tp_size=1) as p, instance_factory(small, tp_size=1) as d:
        pd = PDDriver([p], [d], transport="nixl")
        outs = pd.generate(PROMPTS, long)
        assert [o.tokens for o in outs] == want
        assert [o.mode for o in outs] == [PDMode.HANDOFF] * 3
        (counts,) = d.rank_group.retraction_counters()
        assert counts.restored_requests >= 1
        assert counts.restored_requests == counts.retracted_requests
        _no_leaks(p, d)


def test_transfer_timeout_on_one_prefill_rank_makes_the_decode_side_recompute(
        instance_factory, mixed_answers):
    with instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as p, \
            instance_factory(SETTINGS, tp_size=2) as d:
        # held long enough to outlast the rest of the run on a loaded machine (with 0.3 s
        # the pages were once freed before the check below, under another test's load)
        pd = PDDriver([p], [d], transport="nixl", linger_s=TIMED_OUT_LINGER_S)
        p.on_rank(1, lambda a: a.time_out_next_handoff.remote())
        outs = pd.generate(PROMPTS[:2], GREEDY)
        assert p.on_rank(1, lambda a: a.faults_fired.remote()).get("handoff_timeout") == 1
        assert [o.tokens for o in outs] == mixed_answers[:2]
        assert [o.mode for o in outs] == [PDMode.RECOMPUTED, PDMode.HANDOFF]
        # the timed-out write's target pages are held for the linger, then freed
        assert any(c.reserved_pages for c in d.handoff_counters())
        _no_leaks(p, d, settle=True)


def test_a_prefill_rank_that_dies_in_a_release_costs_its_instance_a_restart_only(
        instance_factory, mixed_answers):
    """A prefill rank dies in the release the driver makes once the decode side has a
    request's KV: that instance replaces its ranks (the pages it held died with them), and
    every request is still answered once, from the KV the decode side has."""
    with instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as p, \
            instance_factory(SETTINGS, tp_size=2) as d:
        pd = PDDriver([p], [d], transport="nixl")
        p.on_rank(1, lambda a: a.crash_in_next.remote("release_handoff"))
        ids = [pd.add(t, GREEDY) for t in PROMPTS]
        outs = _answered_once(pd, ids)
        assert [outs[i].tokens for i in ids] == mixed_answers
        assert [outs[i].mode for i in ids] == [PDMode.HANDOFF] * len(PROMPTS)
        assert (p.restarts, d.restarts) == (1, 0)
        _no_leaks(p, d)


def test_a_decode_rank_that_dies_in_a_cancel_costs_its_instance_a_restart_only(
        instance_factory, mixed_answers):
    """One prefill rank's write times out, and a decode rank dies in the cancel that follows:
    the decode instance replaces its ranks (its reservations died with them) and computes
    both requests from their prompts; each is answered once, as a mixed instance does."""
    with instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as p, \
            instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as d:
        pd = PDDriver([p], [d], transport="nixl", linger_s=LINGER_S)
        p.on_rank(1, lambda a: a.time_out_next_handoff.remote())
        d.on_rank(0, lambda a: a.crash_in_next.remote("handoff_cancel"))
        ids = [pd.add(t, GREEDY) for t in PROMPTS[:2]]
        outs = _answered_once(pd, ids)
        assert [outs[i].tokens for i in ids] == mixed_answers[:2]
        assert [outs[i].mode for i in ids] == [PDMode.RECOMPUTED] * 2
        assert (p.restarts, d.restarts) == (0, 1)
        _no_leaks(p, d, settle=True)


def test_an_abort_whose_cancel_kills_a_decode_rank_leaves_the_others_answered(
        instance_factory, mixed_answers):
    """A request aborted in its prefill stage; a decode rank dies in the cancel of its
    reservation. The other request's reservation died with that rank: its prefill's write
    fails, and the decode instance (new ranks) computes it from its prompt."""
    with instance_factory(SETTINGS, tp_size=1) as p, \
            instance_factory(SETTINGS, tp_size=2, rank_class=FaultyRank) as d:
        pd = PDDriver([p], [d], transport="nixl", linger_s=LINGER_S)
        gone, kept = pd.add(PROMPTS[0], GREEDY), pd.add(PROMPTS[1], GREEDY)
        d.on_rank(1, lambda a: a.crash_in_next.remote("handoff_cancel"))
        assert pd.abort(gone)
        out = _answered_once(pd, [kept])[kept]
        assert out.tokens == mixed_answers[1] and out.mode is PDMode.RECOMPUTED
        assert (p.restarts, d.restarts) == (0, 1)
        _no_leaks(p, d, settle=True)


def test_a_request_its_prefill_ends_moves_no_kv(instance_factory, mixed_answers):
    """One token asked for: served by the prefill instance alone (no reservation, no
    transfer). A first token that is a stop token: its reservation is called off and
    nothing is written."""
    with instance_factory(SETTINGS, tp_size=1) as p, instance_factory(SETTINGS, tp_size=1) as d:
        pd = PDDriver([p], [d], transport="nixl")
        one = SamplingParams(max_new_tokens=1)
        stop = SamplingParams(max_new_tokens=6, stop_token_ids=(mixed_answers[0][0],))
        ids = [pd.add(PROMPTS[1], one), pd.add(PROMPTS[0], stop)]
        outs = _answered_once(pd, ids)
        assert outs[ids[0]].tokens == mixed_answers[1][:1] and outs[ids[0]].mode is PDMode.MIXED
        assert outs[ids[1]].tokens == mixed_answers[0][:1]
        assert outs[ids[1]].finish_reason.value == "stop"
        assert p.handoff_counters()[0].transfers.bytes == 0
        (counters,) = d.handoff_counters()
        assert (counters.desk.reserved, counters.desk.cancelled) == (1, 1)
        _no_leaks(p, d)


def test_a_prefill_never_released_is_forgotten_when_its_hold_ends(instance_factory):
    """The instance and its ranks keep nothing for a finished prefill whose release never
    comes (once the ranks' hold ended), nor for an aborted one."""
    with instance_factory(SETTINGS, tp_size=1, rank_class=FaultyRank) as p, \
            instance_factory(SETTINGS, tp_size=1) as d:
        p.handoff_open("nixl"), d.handoff_open("nixl")
        one = SamplingParams(max_new_tokens=1)
        aborted = p.add_prefill(PROMPTS[1], one, d.reserve_handoff("a", len(PROMPTS[1])))
        assert p.abort(aborted) is not None and p.handed_requests == 0
        p.on_rank(0, lambda a: a.hold_handed_for.remote(0.0))
        p.handed_hold_s = 0.0
        pid = p.add_prefill(PROMPTS[0], one, d.reserve_handoff("b", len(PROMPTS[0])))
        (out,) = p.wait([pid])
        assert p.handed_requests == 0
        p.step()  # the ranks give the pages back at their hold's end
        d.cancel_handoff("a"), d.cancel_handoff("b")
        _no_leaks(p, d)


class ScriptedInstance:
    """An Instance stand-in (no Ray): reserves what it is asked, steps what the test scripts,
    and records the hand-off calls the driver makes."""

    size, restarts, num_pending = 1, 0, 0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.steps: list[InstanceStep] = []

    def handoff_open(self, transport: str, staged: bool = False) -> None:
        pass

    def reserve_handoff(self, handoff_id, num_tokens, hold_s, staged):
        self.calls.append(("reserve", handoff_id))
        return [HandoffTarget(handoff_id, b"", 0, 64, tuple(range(pages_for(num_tokens, PAGE))))]

    def add_prefill(self, tokens, sampling, targets, cache_salt="", request_id=None, label=""):
        return request_id

    def step_report(self) -> InstanceStep:
        return self.steps.pop(0) if self.steps else InstanceStep([], {}, None)

    def cancel_handoff(self, handoff_id, linger_s=0.0) -> None:
        self.calls.append(("cancel", handoff_id, linger_s))

    def release_handoff(self, request_id) -> bool:
        self.calls.append(("release", request_id))
        return True


def test_a_request_its_first_token_ended_after_a_failed_write_lingers():
    """The first token ended the request, but a write to its reservation failed (it may still
    be running): the reservation lingers before its pages go back, as on the recompute path."""
    p, d = ScriptedInstance(), ScriptedInstance()
    pd = PDDriver([p], [d], transport="simulated", linger_s=7.0)
    rid = pd.add(PROMPTS[0], GREEDY)
    ((_, hid),) = d.calls
    out = Output(rid, tuple(PROMPTS[0]), (5,), None, FinishReason.STOP,
                 RequestLengths(0, 0, 0, 0, len(PROMPTS[0])), CachedTokens(0, 0, 0), 0.1, None)
    timed_out = HandoffSent(hid, False, (), 0, 0, 40.0, "the write did not finish in time")
    p.steps.append(InstanceStep([out], {}, None, {rid: [timed_out]}))
    (done,) = pd.step()
    assert done.request_id == rid and done.tokens == (5,)
    assert ("cancel", hid, 7.0) in d.calls and ("release", rid) in p.calls
