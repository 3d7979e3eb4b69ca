"""What the connector keys, refuses and declares, with vLLM's own config and request objects
and no engine: a page's key covers the LoRA adapter (its weights too), each multimodal
item where it sits, prompt embeddings and the cache salt; a request it cannot key neither
loads nor saves; `skip_reading_prefix_cache` loads nothing; layouts it cannot key are refused
at start with the setting named; it asks vLLM for piecewise CUDA graphs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tiny_llama import make_checkpoint
from vllm_required import require_vllm

require_vllm()

from kvtier.connector.plan import WorkerReport  # noqa: E402
from kvtier.connector.request_inputs import AdapterDigests, page_inputs  # noqa: E402
from kvtier.connector.scheduler_side import (ScheduledRequest, SchedulerSide,  # noqa: E402
                                             Unkeyed)
from kvtier.errors import ConfigError  # noqa: E402
from kvtier.keys import KeyNamespace, PageInputs  # noqa: E402

BS = 16
NS = KeyNamespace("m", layout_fingerprint="f")
PROMPT = list(range(300, 300 + 4 * BS + 1))  # 4 full pages


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return make_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", head_dim=32)


def vllm_config(model: Path, **engine):
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(model=str(model), enforce_eager=True, max_model_len=1024,
                      kv_cache_memory_bytes=32 << 20, block_size=BS,
                      kv_transfer_config=KVTransferConfig(kv_connector="KvtierConnector",
                                                          kv_role="kv_both"),
                      **engine).create_engine_config()


def request(req_id: str, tokens=PROMPT, **fields):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = fields.pop("sampling", None) or SamplingParams(max_tokens=1)
    return Request(req_id, list(tokens), params, None, **fields)


def adapter(path: Path, seed: int) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text('{"r": 8, "target_modules": ["q_proj"]}')
    (path / "adapter_model.safetensors").write_bytes(bytes([seed]) * 64)
    return path


def keys(inputs: PageInputs | Unkeyed) -> list[str]:
    assert isinstance(inputs, PageInputs)
    return NS.request_keys(PROMPT[:4 * BS], BS, inputs)


def test_a_lora_adapter_keys_its_pages_by_name_and_weights(tmp_path):
    from vllm.lora.request import LoRARequest

    digests = AdapterDigests()
    one, two = adapter(tmp_path / "one", 1), adapter(tmp_path / "two", 2)
    base = keys(page_inputs(request("base"), BS, digests))
    a = keys(page_inputs(request("a", lora_request=LoRARequest("sql", 1, str(one))), BS,
                         digests))
    b = keys(page_inputs(request("b", lora_request=LoRARequest("chat", 2, str(two))), BS,
                         digests))
    assert base == NS.page_hashes(PROMPT[:4 * BS], BS)  # no adapter: the tokens' keys
    assert not set(base) & set(a) and not set(a) & set(b) and not set(base) & set(b)
    # the same name re-pointed at other weights: other keys
    moved = keys(page_inputs(request("c", lora_request=LoRARequest("sql", 1, str(two))), BS,
                             digests))
    assert not set(moved) & set(a)
    # an adapter whose files are not here (a hub id resolved in another process): unkeyed
    assert page_inputs(request("d", lora_request=LoRARequest("far", 3, "org/adapter")), BS,
                       digests) is Unkeyed.ADAPTER


def feature(identifier: str, offset: int, length: int):
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_multimodal_items_key_the_pages_their_placeholders_touch():
    """Two users, the same text (placeholder tokens alike), different images of one size:
    the pages from the first image on differ; the pages before it are shared."""
    digests = AdapterDigests()
    cat = keys(page_inputs(request("a", mm_features=[feature("cat-digest", 20, 16)]), BS,
                           digests))
    dog = keys(page_inputs(request("b", mm_features=[feature("dog-digest", 20, 16)]), BS,
                           digests))
    text = NS.page_hashes(PROMPT[:4 * BS], BS)
    assert cat[0] == dog[0] == text[0]  # tokens 0-15: before the image
    assert all(c != d for c, d in zip(cat[1:], dog[1:]))
    assert all(c != t for c, t in zip(cat[1:], text[1:]))
    # the same image at another offset is other KV
    moved = keys(page_inputs(request("c", mm_features=[feature("cat-digest", 21, 16)]), BS,
                             digests))
    assert moved[1] != cat[1]
    # an item vLLM gave no identifier: unkeyed
    assert page_inputs(request("d", mm_features=[feature("", 20, 16)]), BS,
                       digests) is Unkeyed.MULTIMODAL


def test_prompt_embeddings_key_each_page_by_its_rows():
    digests = AdapterDigests()
    embeds = torch.randn(len(PROMPT), 8)
    other = embeds.clone()
    other[40] += 1  # page 2 differs
    first = keys(page_inputs(request("a", prompt_embeds=embeds), BS, digests))
    second = keys(page_inputs(request("b", prompt_embeds=other), BS, digests))
    assert first[:2] == second[:2] and first[2] != second[2] and first[3] != second[3]
    assert first[0] != NS.page_hashes(PROMPT[:4 * BS], BS)[0]


def saved_pages(s: SchedulerSide, req_id: str, inputs) -> int:
    s.add(req_id, inputs)
    hit = s.match(req_id, PROMPT, 0)
    s.allocated(req_id, list(range(5)), hit or 0)
    plan = s.plan([ScheduledRequest(req_id, PROMPT, list(range(5)), len(PROMPT))])
    saved = frozenset(slot for save in plan.saves for slot in save.slots)
    s.settle(WorkerReport(saved=saved))
    return len(saved)


def test_a_request_that_cannot_be_keyed_neither_loads_nor_saves():
    s = SchedulerSide(NS, BS, 16)
    assert saved_pages(s, "plain", PageInputs()) == 4
    s.add("lora", Unkeyed.ADAPTER)
    assert s.match("lora", PROMPT, 0) == 0 and s.held("lora", PROMPT, 0) == 0
    assert saved_pages(s, "mm", Unkeyed.MULTIMODAL) == 0
    assert s.take_unkeyed() == {Unkeyed.ADAPTER: 1, Unkeyed.MULTIMODAL: 1}
    assert not s.take_unkeyed()
    # and salts, adapters never meet: each saves its own pages
    assert saved_pages(s, "tenant", PageInputs("tenant-b")) == 4
    assert saved_pages(s, "adapter", PageInputs(adapter="sql@1234")) == 4


def scheduler_connector(config):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                            KVCacheGroupSpec)

    from kvtier.connector.vllm_connector import KvtierConnector

    mc = config.model_config
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=mc.get_total_num_kv_heads(),
                             head_size=mc.get_head_size(), dtype=mc.dtype)
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    kv = KVCacheConfig(num_blocks=32, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
    return KvtierConnector(config, KVConnectorRole.SCHEDULER, kv)


def test_skip_reading_prefix_cache_loads_nothing_and_still_saves(model):
    from vllm import SamplingParams

    connector = scheduler_connector(vllm_config(model))
    sched = connector._scheduler
    assert saved_pages(sched, "warm", PageInputs()) == 4  # L2 holds the prompt
    plain = request("plain")
    connector.on_new_request(plain)
    assert connector.get_num_new_matched_tokens(plain, 0) == (4 * BS, False)
    logprobs = request("logprobs", sampling=SamplingParams(max_tokens=1, prompt_logprobs=1))
    assert logprobs.skip_reading_prefix_cache
    connector.on_new_request(logprobs)
    assert connector.get_num_new_matched_tokens(logprobs, 0) == (0, False)
    assert connector.held_tokens(logprobs, 0) == 4 * BS  # what L2 holds; the scheduler skips
    # its blocks are still saved (a new prompt: nothing in L2 yet)
    fresh = request("fresh-logprobs", tokens=[t + 1000 for t in PROMPT],
                    sampling=SamplingParams(max_tokens=1, prompt_logprobs=1))
    connector.on_new_request(fresh)
    connector.update_state_after_alloc(fresh, _Blocks(list(range(5))), 0)
    plan = sched.plan([ScheduledRequest("fresh-logprobs", fresh.all_token_ids, list(range(5)),
                                        len(PROMPT))])
    assert sum(len(save.slots) for save in plan.saves) == 4


def test_an_unkeyed_request_is_counted_in_the_connectors_stats(model, tmp_path):
    from vllm.lora.request import LoRARequest

    connector = scheduler_connector(vllm_config(model))
    far = request("far", lora_request=LoRARequest("far", 3, str(tmp_path / "absent")))
    connector.on_new_request(far)
    assert connector.get_num_new_matched_tokens(far, 0) == (0, False)
    stats = connector.get_kv_connector_stats().copies()
    assert stats.unkeyed_adapter_requests == 1 and stats.unkeyed_multimodal_requests == 0
    assert connector.get_kv_connector_stats() is None  # taken once


class _Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


def test_pipeline_and_context_parallelism_are_refused_at_start(model):
    from kvtier.connector.supported import refuse_unsupported

    refuse_unsupported(vllm_config(model))  # TP 1, no PP: fine
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
        scheduler_connector(vllm_config(model, pipeline_parallel_size=2))
    with pytest.raises(ConfigError, match="decode_context_parallel_size=2"):
        refuse_unsupported(vllm_config(model, tensor_parallel_size=4,
                                       decode_context_parallel_size=2))


def test_the_connector_asks_for_piecewise_cuda_graphs():
    from kvtier.connector.vllm_connector import KvtierConnector

    assert KvtierConnector.requires_piecewise_for_cudagraph({}) is True
