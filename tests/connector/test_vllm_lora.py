"""KvtierConnector under vLLM with LoRA adapters, on a tiny random Llama: the same prompt under
the base model and two adapters never shares a page (each is computed cold the first time,
whatever the others left in L2), and each hits its own pages the second time with its cold
answer. vLLM's prefix cache is off: every cached token came from kvtier's L2."""
from __future__ import annotations

import os

import pytest

from tiny_llama import make_checkpoint, make_lora_adapter
from vllm_required import require_vllm

require_vllm()

BLOCK = 32
PROMPT = list(range(1000, 1200))  # 6 full blocks, the last token computed
REUSABLE = (len(PROMPT) - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "1")
    root = tmp_path_factory.mktemp("lora")
    model = make_checkpoint(root / "tiny", head_dim=32)
    adapters = [make_lora_adapter(root / name, model, seed) for name, seed in
                (("sql", 1), ("chat", 2))]
    engine = LLM(model=str(model), enforce_eager=True, enable_prefix_caching=False,
                 max_model_len=1024, max_num_seqs=2, kv_cache_memory_bytes=32 << 20,
                 block_size=BLOCK, enable_lora=True, max_lora_rank=8, max_loras=2,
                 kv_transfer_config=KVTransferConfig(
                     kv_connector="KvtierConnector", kv_role="kv_both",
                     kv_connector_extra_config={"hicache_ratio": 2.0}))
    yield engine, adapters
    engine.llm_engine.engine_core.shutdown()


def ask(engine, lora) -> tuple[int, list[int]]:
    from vllm import SamplingParams

    out = engine.generate([{"prompt_token_ids": PROMPT}],
                          SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                          lora_request=lora, use_tqdm=False)[0]
    return out.num_cached_tokens or 0, list(out.outputs[0].token_ids)


def test_two_adapters_and_the_base_model_never_share_a_page(llm):
    from vllm.lora.request import LoRARequest

    engine, (sql, chat) = llm
    runs = {}
    for name, lora in (("base", None), ("sql", LoRARequest("sql", 1, str(sql))),
                       ("chat", LoRARequest("chat", 2, str(chat)))):
        cold = ask(engine, lora)
        assert cold[0] == 0, f"{name} hit pages another adapter computed"
        again = ask(engine, lora)
        assert again == (REUSABLE, cold[1]), name  # its own pages, its cold answer
        runs[name] = cold[1]
    assert len({tuple(answer) for answer in runs.values()}) == 3  # each adapter matters
