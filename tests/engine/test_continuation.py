"""An answer is never spliced: a request that loses its KV goes on after the tokens it gave
(default mode: they join its prompt; deterministic mode: it runs again and must repeat them),
a request can be added to go on after an answer its caller has (`Resume`), and a request whose
next token cannot be chosen ends alone while its batch-mates go on."""
from __future__ import annotations

import pytest
import torch
from cache_builder import build_cache

from kvtier.engine import Engine, FinishReason, SamplingParams
from kvtier.engine.request import Resume
from kvtier.engine.sampling import Sampler, SamplingError

PAGE = 16


def toks(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model, device_pages: int = 64, deterministic: bool = False) -> Engine:
    cache = build_cache(model.kv_spec(PAGE), device_pages, model="tiny", hicache_ratio=4.0,
                        load_back_threshold_tokens=PAGE)
    return Engine(model, cache, owns_cache=True, deterministic=deterministic)


def run_watching(eng: Engine) -> tuple[dict, dict[int, list[tuple[int, ...]]]]:
    """Step until done; the outputs by id and every answer seen while running."""
    seen: dict[int, list[tuple[int, ...]]] = {}
    outs = {}
    for _ in range(2000):
        if not eng.has_unfinished:
            break
        for out in eng.step():
            outs[out.request_id] = out
        for req in eng.scheduler.running + eng.scheduler.waiting:
            seen.setdefault(req.id, []).append(req.answer)
    return outs, seen


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_preempted_answer_keeps_every_token_it_gave(tiny_models, deterministic) -> None:
    model = tiny_models[torch.float32]
    prompts = [toks(60, 50 + i) for i in range(4)]
    params = SamplingParams(max_new_tokens=20, temperature=0.8, seed=3)
    with engine(model, deterministic=deterministic) as eng:
        reference = [o.tokens for o in eng.generate(prompts, params)]
    with engine(model, device_pages=13, deterministic=deterministic) as eng:
        eng.scheduler.retraction.enabled = False  # preempt (recompute), never retract
        for p in prompts:
            eng.add_request(p, params)
        preempted = 0
        outs: dict = {}
        seen: dict[int, list[tuple[int, ...]]] = {}
        while eng.has_unfinished:
            for out in eng.step():
                outs[out.request_id] = out
            preempted += eng.last_step.preempted
            for req in eng.scheduler.running + eng.scheduler.waiting:
                seen.setdefault(req.id, []).append(req.answer)
        assert preempted, "three sequences outgrow 13 pages: some are preempted"
        assert all(o.finish_reason is FinishReason.LENGTH and len(o.tokens) == 20
                   for o in outs.values()) and len(outs) == 4
    for req_id, answers in seen.items():
        final = outs[req_id].tokens
        # deterministic mode regrows an answer from none, repeating it; by default it is
        # never shorter than before: what a client got stays the start of the answer
        for a in answers:
            assert final[:len(a)] == a
        if not deterministic:
            assert all(len(b) >= len(a) for a, b in zip(answers, answers[1:]))
    if deterministic:  # bit-identical KV and per-position seeds: the same answers
        assert [outs[i].tokens for i in sorted(outs)] == reference


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_resumed_request_goes_on_after_the_tokens_given(tiny_models, deterministic,
                                                          temperature) -> None:
    model = tiny_models[torch.float32]
    prompt = toks(40, 7)
    params = SamplingParams(max_new_tokens=12, temperature=temperature, seed=11, logprobs=2)
    with engine(model, deterministic=deterministic) as eng:
        (cold,) = eng.generate([prompt], params)
    with engine(model, deterministic=deterministic) as eng:
        rid = eng.add_request(prompt, params, resume=Resume(cold.tokens[:5],
                                                            cold.logprobs[:5]))
        outs, _ = run_watching(eng)
    out = outs[rid]
    assert out.prompt == tuple(prompt)  # the prompt it was asked, not what it recomputed
    assert out.tokens[:5] == cold.tokens[:5]
    assert len(out.logprobs) == len(out.tokens) == 12
    # per-position seeds: the sixth token is drawn as the first run drew it, and the KV of
    # the five given tokens is the same (tiny fp32 model): the same answer
    assert out.tokens == cold.tokens
    assert out.lengths.extend_len == (40 + 5 if not deterministic else 40)


def test_a_resume_that_brought_the_whole_answer_finishes_at_once(tiny_models) -> None:
    model = tiny_models[torch.float32]
    with engine(model) as eng:
        rid = eng.add_request(toks(20, 1), SamplingParams(max_new_tokens=3),
                              resume=Resume((5, 6, 7)))
        stop = eng.add_request(toks(20, 1), SamplingParams(max_new_tokens=9,
                                                            stop_token_ids=(6,)),
                               resume=Resume((5, 6)))
        outs = {o.request_id: o for o in eng.step()}
        assert eng.last_step.forwards == 0 and not eng.has_unfinished
    assert outs[rid].tokens == (5, 6, 7) and outs[rid].finish_reason is FinishReason.LENGTH
    assert outs[stop].tokens == (5, 6) and outs[stop].finish_reason is FinishReason.STOP


def test_a_resume_too_long_for_l1_stops_there(tiny_models) -> None:
    model = tiny_models[torch.float32]
    with engine(model, device_pages=4) as eng:
        rid = eng.add_request(toks(40, 2), SamplingParams(max_new_tokens=200),
                              resume=Resume(tuple(range(30))))
        (out,) = eng.step()
    assert out.request_id == rid and out.finish_reason is FinishReason.NO_MEMORY
    assert out.tokens == tuple(range(30))


def test_a_request_whose_next_token_fails_ends_alone(tiny_models, caplog) -> None:
    model = tiny_models[torch.float32]
    prompts = [toks(30, 20 + i) for i in range(3)]
    params = SamplingParams(max_new_tokens=8)
    with engine(model) as eng:
        reference = [o.tokens for o in eng.generate(prompts, params)]
    with engine(model) as eng:
        ids = [eng.add_request(p, params) for p in prompts]
        victim = next(r for r in eng.scheduler.waiting if r.id == ids[1])
        real = victim.sampler

        class Broken:
            params, logprobs = real.params, []

            def __call__(self, logits):
                if len(victim.output) == 3:
                    raise RuntimeError("a bug in a sampler, with internal details")
                return real(logits)

        victim.sampler = Broken()
        outs, _ = run_watching(eng)
        assert not eng.scheduler.running and not eng.scheduler.waiting
        audit = eng.cache.audit()
    failed = outs[ids[1]]
    assert failed.finish_reason is FinishReason.ERROR and failed.tokens == reference[1][:3]
    assert failed.error == "choosing its next token failed (RuntimeError)"  # no details
    assert "internal details" in caplog.text  # the log keeps them
    assert [outs[ids[0]].tokens, outs[ids[2]].tokens] == [reference[0], reference[2]]
    assert not any(audit._asdict().values()), audit


def test_the_sampler_never_gives_nan() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    # a temperature so small that logits / temperature overflow: its limit, greedy
    assert Sampler(SamplingParams(temperature=1e-40, seed=1))(logits) == 1
    # a tiny repetition penalty makes seen logits huge: still a token, never NaN
    rep = Sampler(SamplingParams(temperature=1.0, repetition_penalty=1e-39, seed=1),
                  prompt=[0, 1, 2, 3])
    assert rep(logits) in range(4)
    both = Sampler(SamplingParams(temperature=1e-30, repetition_penalty=1e-39, seed=1),
                   prompt=[2])
    assert both(logits) == 2  # 2.0 / 1e-39 is the largest
    nan = torch.tensor([float("nan"), 0.5, float("nan"), 0.1])
    assert Sampler(SamplingParams())(nan) == 1
    assert {Sampler(SamplingParams(temperature=1.0, seed=s))(nan) for s in range(20)} <= {1, 3}
    lp = Sampler(SamplingParams(logprobs=2))
    assert lp(torch.tensor([float("inf"), 0.0, 1.0])) == 0
    with pytest.raises(SamplingError, match="no finite logit"):
        Sampler(SamplingParams())(torch.full((4,), float("nan")))


def test_position_seeds_make_a_draw_independent_of_what_came_before() -> None:
    logits = torch.zeros(50)
    a = Sampler(SamplingParams(temperature=1.0, seed=5))
    first = [a(logits) for _ in range(6)]
    b = Sampler(SamplingParams(temperature=1.0, seed=5), answered=first[:4])
    assert [b(logits), b(logits)] == first[4:]
    assert len(set(first)) > 1  # they are draws, not one token
