"""Prefill/decode hand-off between two engines in one process: a decode engine that takes
the prompt KV a prefill engine sent gives the mixed engine's answer; a corrupt page or a
failed transfer makes it recompute; reservations and handed-off pages never leak."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from cache_builder import build_cache

from kvtier.backends.transport_registry import open_endpoint
from kvtier.engine.engine import Engine
from kvtier.engine.handoff import HandoffTarget, IncomingKV, Staging, rank_sums
from kvtier.engine.handoff_sender import HandoffSender
from kvtier.engine.request import FinishReason
from kvtier.engine.sampling import SamplingParams
from kvtier.errors import ConfigError

PAGE = 4


def _engine(model, deterministic=False, pages=64, layout="page_first") -> Engine:
    cache = build_cache(model.kv_spec(PAGE), pages, model="tiny", mem_layout=layout)
    return Engine(model, cache, owns_cache=True, deterministic=deterministic)


class _Pair:
    """A prefill engine and a decode engine joined by simulated endpoints."""

    def __init__(self, model, deterministic=False, transport="simulated", staged=False):
        layout = "page_head" if staged else "page_first"
        self.P, self.D = (_engine(model, deterministic, layout=layout) for _ in range(2))
        self.staged = staged
        self.ep_p = open_endpoint(transport, "test-prefill")
        self.ep_d = open_endpoint(transport, "test-decode")
        for pool in (self.D.cache.device_pool, self.D.cache.host_pool):
            self.ep_d.register(pool.kv.data_ptr(), pool.kv.numel() * pool.kv.element_size())
        self.heads = (0, self.P.cache.spec.num_kv_heads)
        self.sender = HandoffSender(self.ep_p, self.P.cache, self.heads)

    def target(self, hid, n, hold_s=30.0, write_by=0.0):
        held = self.D.reserve_handoff(hid, n, hold_s, staged=self.staged)
        assert held is not None
        pool, host = self.D.cache.device_pool, self.D.cache.host_pool
        staging = Staging(host.kv.data_ptr(), host.num_pages, tuple(held.staged)) \
            if self.staged else None
        return HandoffTarget(hid, self.ep_d.address(), pool.kv.data_ptr(), pool.num_pages,
                             tuple(held.pages), write_by, self.heads, staging)

    def prefill(self, prompt, target, sampling):
        pid = self.P.add_request(prompt, dataclasses.replace(sampling, max_new_tokens=1),
                                 handoff_to=[target])
        outs = []
        while not outs:
            outs = self.P.step()
        sent = self.sender.send_new([r for r, _ in self.P.scheduler.handed.values()])
        return pid, outs[0], sent[0]

    def decode(self, prompt, target, first, sent, sampling, corrupt=None):
        if corrupt is not None and self.staged:
            self.D.cache.host_pool.layer_page_view()[0, 0, target.staging.pages[corrupt]] += 1.0
        elif corrupt is not None:
            self.D.cache.device_pool.kv[0, 0, target.pages[corrupt]] += 1.0
        staged = target.staging.pages if self.staged else ()
        did = self.D.add_received(prompt, sampling, IncomingKV(
            target.handoff_id, target.pages, rank_sums(target, [sent]), first, None, staged))
        return did

    def run(self, prompt, sampling, hid="h", corrupt=None):
        t = self.target(hid, len(prompt))
        pid, out, sent = self.prefill(prompt, t, sampling)
        assert sent.ok, sent.error
        self.decode(prompt, t, out.tokens[0], sent, sampling, corrupt)
        self.P.release_handoff(pid)
        res = []
        while not res:
            res = self.D.step()
        return res[0]

    def audit(self):
        for e in (self.P, self.D):
            e.cache.flush()
            assert not any(e.cache.audit()), e.cache.audit()

    def close(self):
        self.P.close(), self.D.close(), self.ep_p.close(), self.ep_d.close()


@pytest.fixture
def tiny(tiny_models):
    return tiny_models[torch.float32]


PROMPTS = [list(range(5, 35)), list(range(40, 72)), [7] * 3]  # partial, whole pages, short


@pytest.mark.parametrize("deterministic, staged", [(False, False), (True, False),
                                                    (False, True)])
def test_pd_answers_equal_mixed(tiny, deterministic, staged):
    """Straight into L1, and staged through L2 head objects (as for another TP size)."""
    sp = SamplingParams(max_new_tokens=9)
    mixed = _engine(tiny, deterministic)
    want = [o.tokens for o in mixed.generate(PROMPTS, sp)]
    pair = _Pair(tiny, deterministic, staged=staged)
    try:
        got = [pair.run(p, sp, hid=f"h{i}").tokens for i, p in enumerate(PROMPTS)]
        assert got == want
        counters = pair.D.scheduler.admission.handoffs.counters
        assert counters.adopted == len(PROMPTS) and counters.recomputed == 0
        assert pair.D.cache.counters.device_hit_tokens == 0  # nothing came from its cache
        pair.audit()
    finally:
        pair.close()
        mixed.close()


def test_pd_seeded_sampling_equal_mixed(tiny):
    """The decode side continues the prefill sampler's generator."""
    sp = SamplingParams(max_new_tokens=12, temperature=1.0, seed=7)
    mixed = _engine(tiny)
    (want,) = mixed.generate([PROMPTS[0]], sp)
    pair = _Pair(tiny)
    try:
        assert pair.run(PROMPTS[0], sp).tokens == want.tokens
    finally:
        pair.close()
        mixed.close()


@pytest.mark.parametrize("staged", [False, True])
def test_corrupt_page_is_recomputed(tiny, staged):
    sp = SamplingParams(max_new_tokens=6)
    mixed = _engine(tiny)
    (want,) = mixed.generate([PROMPTS[0]], sp)
    pair = _Pair(tiny, staged=staged)
    try:
        out = pair.run(PROMPTS[0], sp, corrupt=2)
        assert out.tokens == want.tokens
        c = pair.D.scheduler.admission.handoffs.counters
        assert (c.adopted, c.recomputed) == (0, 1) and c.pages_corrupt >= 1
        # computed from its prompt, going on after the prefill side's first token (a client
        # may have it already): that token's KV is computed as part of the prompt too
        assert out.lengths.extend_len == len(PROMPTS[0]) + 1
        pair.audit()
    finally:
        pair.close()
        mixed.close()


def test_prefill_pages_held_until_release_then_cached(tiny):
    sp = SamplingParams(max_new_tokens=4)
    pair = _Pair(tiny)
    try:
        t = pair.target("h", len(PROMPTS[1]))
        pid, out, sent = pair.prefill(PROMPTS[1], t, sp)
        assert pid in pair.P.scheduler.handed
        free = pair.P.cache.free_device_pages
        pair.P.cache.evict_device(pair.P.cache.device_pages)  # nothing handed off is evictable
        assert pair.P.cache.free_device_pages == free
        assert pair.P.release_handoff(pid) and not pair.P.scheduler.handed
        assert pair.P.cache.peek(PROMPTS[1]).device_hit_length == len(PROMPTS[1])
        pair.D.handoffs.cancel("h")
        pair.audit()
    finally:
        pair.close()


def test_unreleased_handoff_expires(tiny):
    pair = _Pair(tiny)
    try:
        pair.P.scheduler.handed_hold_s = 0.05
        t = pair.target("h", len(PROMPTS[0]), hold_s=0.05)
        pair.prefill(PROMPTS[0], t, SamplingParams(max_new_tokens=4))
        time.sleep(0.06)
        pair.P.step()
        assert not pair.P.scheduler.handed
        assert pair.D.handoffs.expire() == 1 and pair.D.handoffs.held_pages == 0
        pair.audit()
    finally:
        pair.close()


def test_missing_reservation_recomputes(tiny):
    """A decode request whose reservation expired is computed from its prompt."""
    sp = SamplingParams(max_new_tokens=5)
    mixed = _engine(tiny)
    (want,) = mixed.generate([PROMPTS[0]], sp)
    pair = _Pair(tiny)
    try:
        t = pair.target("h", len(PROMPTS[0]))
        pid, out, sent = pair.prefill(PROMPTS[0], t, sp)
        pair.D.handoffs.cancel("h")
        pair.decode(PROMPTS[0], t, out.tokens[0], sent, sp)
        pair.P.release_handoff(pid)
        res = []
        while not res:
            res = pair.D.step()
        assert res[0].tokens == want.tokens
        assert pair.D.scheduler.admission.handoffs.counters.recomputed == 1
        pair.audit()
    finally:
        pair.close()
        mixed.close()


def test_write_deadline_passed_sends_nothing(tiny):
    pair = _Pair(tiny)
    try:
        t = pair.target("h", len(PROMPTS[0]), write_by=time.time() - 1)
        pid, _, sent = pair.prefill(PROMPTS[0], t, SamplingParams(max_new_tokens=4))
        assert not sent.ok and "deadline" in sent.error
        assert pair.ep_p.counters.bytes == 0
        pair.P.release_handoff(pid)
        pair.D.handoffs.cancel("h")
        pair.audit()
    finally:
        pair.close()


def test_failed_transfer_is_reported(tiny):
    pair = _Pair(tiny)
    try:
        t = pair.target("h", len(PROMPTS[0]))
        bad = t._replace(base_addr=t.base_addr + (1 << 40))  # outside anything registered
        pid, _, sent = pair.prefill(PROMPTS[0], bad, SamplingParams(max_new_tokens=4))
        assert not sent.ok and sent.error
        pair.P.release_handoff(pid)
        pair.D.handoffs.cancel("h")
        pair.audit()
    finally:
        pair.close()


def test_reservation_refused_when_l1_full(tiny):
    d = _engine(tiny, pages=4)
    try:
        assert d.reserve_handoff("a", 4 * PAGE) is not None
        assert d.reserve_handoff("b", PAGE) is None
        assert d.handoffs.counters.refused == 1
        with pytest.raises(ConfigError):
            d.reserve_handoff("a", PAGE)  # ids are unique
        assert d.handoffs.cancel("a") and d.cache.free_device_pages == 4
    finally:
        d.close()


def test_a_prompt_that_does_not_fit_next_to_hand_off_reservations_waits_for_them(tiny):
    """A decode engine whose L1 is held by hand-off reservations (prefills still to come)
    keeps a request that does not fit next to them waiting, refuses new reservations
    meanwhile (they would take the pages it waits for), and runs it whole once they are
    gone. It was refused (NO_MEMORY, with the answer it had: a decode instance whose ranks
    were replaced cut resumed answers short under kvtier bench chaos --pd)."""
    d = _engine(tiny, pages=8)
    try:
        assert d.reserve_handoff("a", 5 * PAGE) is not None  # 5 of the 8 pages
        rid = d.add_request(list(range(100, 100 + 4 * PAGE + 1)),
                            SamplingParams(max_new_tokens=3))  # 5 pages + 1 to decode into
        for _ in range(4):
            assert d.step() == []  # waits: L1 is full for now, not for good
        # new hand-offs would take the pages it waits for: refused (served mixed) meanwhile
        assert d.reserve_handoff("b", PAGE) is None and d.handoffs.counters.refused == 1
        assert d.handoffs.cancel("a")
        outs = []
        for _ in range(20):
            outs += d.step()
            if outs:
                break
        assert [(o.request_id, o.finish_reason, len(o.tokens)) for o in outs] == \
            [(rid, FinishReason.LENGTH, 3)]
    finally:
        d.close()


def test_regions_cover_each_page_once(tiny):
    spec = tiny.kv_spec(PAGE)
    with build_cache(spec, 8, model="tiny") as cache:
        kv = cache.device_pool.kv
        rows = cache.exchange.l1_regions([3, 0])
        assert len(rows) == 2 * 2 * spec.num_layers
        assert int(rows[:, 1].sum()) == 2 * spec.page_bytes
        kv[:, :, 3] = 1.5
        view = torch.frombuffer(bytearray(kv.numpy().tobytes()), dtype=torch.uint8)
        base = kv.data_ptr()
        for addr, n in rows[: len(rows) // 2].tolist():
            part = view[addr - base: addr - base + n].view(kv.dtype)
            assert torch.all(part == 1.5)
        assert cache.exchange.l1_sums([3]) != cache.exchange.l1_sums([0])


def test_abort_before_adoption_frees_the_received_pages(tiny):
    pair = _Pair(tiny)
    try:
        t = pair.target("h", len(PROMPTS[0]))
        pid, out, sent = pair.prefill(PROMPTS[0], t, SamplingParams(max_new_tokens=4))
        did = pair.decode(PROMPTS[0], t, out.tokens[0], sent, SamplingParams(max_new_tokens=4))
        pair.P.release_handoff(pid)
        assert pair.D.abort(did) is not None
        pair.audit()
    finally:
        pair.close()


def test_a_first_token_that_stops_sends_nothing(tiny):
    """The prefill's first token is a stop token: the request ended there, so no KV moves."""
    pair = _Pair(tiny)
    try:
        (cold,) = _engine(tiny).generate([PROMPTS[0]], SamplingParams(max_new_tokens=1))
        t = pair.target("h", len(PROMPTS[0]))
        stop = SamplingParams(max_new_tokens=1, stop_token_ids=(cold.tokens[0],))
        pid = pair.P.add_request(PROMPTS[0], stop, handoff_to=[t])
        outs = []
        while not outs:
            outs = pair.P.step()
        assert outs[0].finish_reason.value == "stop"
        assert pair.sender.send_new(r for r, _ in pair.P.scheduler.handed.values()) == []
        assert pair.ep_p.counters.bytes == 0
        pair.P.release_handoff(pid)
        pair.sender.send_new([])
        assert pair.sender.unreleased == 0
        pair.D.handoffs.cancel("h")
        pair.audit()
    finally:
        pair.close()


def test_the_sender_forgets_requests_whose_hold_expired(tiny):
    """A handed-off request whose release never came: the scheduler frees its pages at the
    hold's end, and the sender stops tracking it (no entry per such request is kept)."""
    pair = _Pair(tiny)
    try:
        pair.P.scheduler.handed_hold_s = 0.0  # expires at the next step
        t = pair.target("h", len(PROMPTS[0]))
        _, _, sent = pair.prefill(PROMPTS[0], t, SamplingParams(max_new_tokens=4))
        assert sent.ok and pair.sender.unreleased == 1
        pair.P.step()
        assert not pair.P.scheduler.handed
        assert pair.sender.send_new(r for r, _ in pair.P.scheduler.handed.values()) == []
        assert pair.sender.unreleased == 0
        pair.D.handoffs.cancel("h")
        pair.audit()
    finally:
        pair.close()


class _Clocked:
    """An endpoint whose writes each take `write_s` of an injected wall clock, recording the
    timeout each was given (and raising `error` instead, when set)."""

    def __init__(self, real, now: list[float], write_s: float, error: Exception | None = None):
        self.real, self.now, self.write_s, self.error = real, now, write_s, error
        self.timeouts: list[float] = []

    def __getattr__(self, name):
        return getattr(self.real, name)

    def write(self, peer, local, remote, timeout_s):
        self.timeouts.append(timeout_s)
        if self.error is not None:
            raise self.error
        self.now[0] += self.write_s
        return self.real.write(peer, local, remote, timeout_s)


def _two_staged_targets(pair, n):
    """One reservation, written as two decode ranks holding half the KV heads each."""
    t = pair.target("h", n)
    half = pair.heads[1] // 2
    return [t._replace(heads=(0, half), write_by=1010.0),
            t._replace(heads=(half, pair.heads[1]), write_by=1010.0)]


@pytest.mark.parametrize("write_s, timeouts, ok", [(4.0, [10.0, 6.0], True),
                                                   (11.0, [10.0], False)])
def test_each_staged_write_gets_only_the_time_left_before_write_by(tiny, write_s, timeouts, ok):
    """Every write to a decode rank may run only until `write_by`; one that would start past
    it is not started (the decode rank may have freed its staging pages by then)."""
    pair = _Pair(tiny, staged=True)
    now = [1000.0]
    clocked = _Clocked(pair.ep_p, now, write_s)
    pair.sender = HandoffSender(clocked, pair.P.cache, pair.heads, clock=lambda: now[0])
    try:
        targets = _two_staged_targets(pair, len(PROMPTS[0]))
        pid = pair.P.add_request(PROMPTS[0], SamplingParams(max_new_tokens=1),
                                 handoff_to=targets)
        while not pair.P.step():
            pass
        (sent,) = pair.sender.send_new(r for r, _ in pair.P.scheduler.handed.values())
        assert clocked.timeouts == timeouts
        assert sent.ok is ok and (ok or "deadline" in sent.error)
        pair.P.release_handoff(pid)
        pair.D.handoffs.cancel("h")
        pair.audit()  # the L2 staging pages went back either way
    finally:
        pair.close()


@pytest.mark.parametrize("staged", [False, True])
def test_a_transport_error_of_any_kind_is_a_failed_send(tiny, staged):
    """A transport library's own exception (not a kvtier error) fails the send, logged; it
    never escapes into the rank's step."""
    pair = _Pair(tiny, staged=staged)
    broken = _Clocked(pair.ep_p, [0.0], 0.0, error=RuntimeError("NIXL_ERR_BACKEND"))
    pair.sender = HandoffSender(broken, pair.P.cache, pair.heads)
    try:
        t = pair.target("h", len(PROMPTS[0]))
        pid, _, sent = pair.prefill(PROMPTS[0], t, SamplingParams(max_new_tokens=4))
        assert not sent.ok and "NIXL_ERR_BACKEND" in sent.error and broken.timeouts
        pair.P.release_handoff(pid)
        pair.D.handoffs.cancel("h")
        pair.audit()
    finally:
        pair.close()
