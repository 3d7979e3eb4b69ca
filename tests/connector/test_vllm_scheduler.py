"""KvtierScheduler (hit-first admission) inside vLLM's CPU build, on a tiny random Llama with
KvtierConnector's L2 and vLLM's prefix cache off (every hit is L2's). The engine core runs in
this process, so one `step()` is one scheduler step and the test sees the scheduler's state.

The story of `kvtier bench serve --engine vllm`: two cold prompts arrive, the first starts its
prefill in 512-token chunks, then a follow-up whose whole prompt L2 holds arrives behind them.
vLLM's own order would run it after both cold prompts; hit-first runs it at once, preempting
the cold prefill for the token budget (its first chunk is in L2 already), and the preempted
prompt resumes from L2 with the answer it gives alone."""
from __future__ import annotations

import os

import pytest

from vllm_required import require_vllm

require_vllm()

BLOCK = 64
COLD_TOKENS = 1100


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    from kvtier.vllm_engine.instance import HIT_FIRST
    from tiny_llama import make_checkpoint

    model = make_checkpoint(tmp_path_factory.mktemp("tiny"), head_dim=32)
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING",
                                            "VLLM_CPU_OMP_THREADS_BIND", "HF_HUB_OFFLINE")}
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="1",
                      HF_HUB_OFFLINE="1")
    try:
        engine = LLM(model=str(model), enforce_eager=True, enable_prefix_caching=False,
                     max_model_len=2048, max_num_seqs=4, kv_cache_memory_bytes=8 << 20,
                     max_num_batched_tokens=512, block_size=BLOCK, scheduler_cls=HIT_FIRST,
                     kv_transfer_config=KVTransferConfig(kv_connector="KvtierConnector",
                                                         kv_role="kv_both"))
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    yield engine
    engine.llm_engine.engine_core.shutdown()


def prompt(first: int) -> list[int]:
    return [1000 + (first + 7 * i) % 3000 for i in range(COLD_TOKENS)]


def params(tokens: int, delta: bool = False):
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    kind = RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, output_kind=kind)


def alone(llm, ids: list[int], tokens: int, salt: str | None = None) -> tuple[int, list[int]]:
    request = {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
    out = llm.generate([request], params(tokens), use_tqdm=False)[0]
    return out.num_cached_tokens or 0, list(out.outputs[0].token_ids)


def test_a_follow_up_held_in_l2_preempts_a_cold_prefill_and_both_answer_as_alone(llm):
    from kvtier.connector.vllm_scheduler import KvtierScheduler

    follow_up, first_cold, second_cold = prompt(0), prompt(1), prompt(2)
    # the answers each prompt gives alone and cold (a salt of its own: nothing shared)
    expected = {name: alone(llm, ids, tokens, salt="reference")[1] for name, ids, tokens in
                (("follow_up", follow_up, 4), ("first", first_cold, 16),
                 ("second", second_cold, 16))}
    assert alone(llm, follow_up, 4)[0] == 0  # cold: its pages go to L2
    assert alone(llm, follow_up, 4) == ((COLD_TOKENS - 1) // BLOCK * BLOCK,
                                        expected["follow_up"])  # L2 holds it

    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    assert isinstance(scheduler, KvtierScheduler)
    answers: dict[str, list[int]] = {"first": [], "second": [], "follow_up": []}
    first_token_step: dict[str, int] = {}
    engine.add_request("first", {"prompt_token_ids": first_cold}, params(16, delta=True))
    engine.add_request("second", {"prompt_token_ids": second_cold}, params(16, delta=True))
    for step in range(200):
        if step == 1:  # the first cold prompt computed its first chunk (and saved it)
            (first,) = [r for r in scheduler.running if r.request_id.startswith("first")]
            assert first.num_computed_tokens == 512
            engine.add_request("follow_up", {"prompt_token_ids": follow_up},
                               params(4, delta=True))
        for out in engine.step():
            name = next(n for n in answers if out.request_id.startswith(n))
            answers[name] += out.outputs[0].token_ids
            if out.outputs[0].token_ids:
                first_token_step.setdefault(name, step)
        if not engine.has_unfinished_requests():
            break
    assert answers == expected
    # the follow-up answered first, before either cold prompt's first token
    assert first_token_step["follow_up"] < min(first_token_step["first"],
                                               first_token_step["second"])
    assert first.num_preemptions == 1  # preempted once, for the follow-up's token budget
