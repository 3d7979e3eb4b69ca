"""The paged model on the tiny config: HF parity, page tables, the per-layer hook, chunking."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import hf_llama, pages_for

from kvtier.engine import (ModelRunner, PagedLlama, SeqChunk, chunk_bounds, load_tiny_model,
                           random_state_dict, tiny_config)
from kvtier.errors import CacheUsageError, ConfigError
from kvtier.tiers.device_pool import DevicePool


def tokens(n: int, seed: int = 0, vocab: int = 256) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_chunk_bounds_sit_on_an_absolute_grid() -> None:
    assert chunk_bounds(0, 40, 16) == [(0, 16), (16, 32), (32, 40)]
    assert chunk_bounds(32, 40, 16) == [(32, 40)]
    assert chunk_bounds(20, 50, 16) == [(20, 32), (32, 48), (48, 50)]
    assert chunk_bounds(5, 5, 16) == []


@pytest.mark.parametrize("tie", [True, False])
def test_tiny_matches_hf_transformers(tie: bool) -> None:
    config = tiny_config()
    config = type(config)(**{**config.to_dict(), "tie_word_embeddings": tie})
    state = random_state_dict(config, seed=1)
    model = PagedLlama.from_state_dict(config, state, torch.float32, "cpu")
    ids = tokens(45)
    with torch.no_grad():
        ref = hf_llama(config, state)(torch.tensor([ids])).logits[0]
    with DevicePool(model.kv_spec(16), 3, device="cpu") as pool:
        mine = ModelRunner(model, pool).prefill(ids, 0, [2, 0, 1], all_logits=True)
    assert mine.shape == ref.shape
    torch.testing.assert_close(mine, ref, atol=1e-4, rtol=1e-4)


def test_page_ids_do_not_matter(tiny_models) -> None:
    model = tiny_models[torch.float32]
    ids = tokens(70)
    results = []
    for pages in ([0, 1, 2, 3, 4], [9, 3, 7, 0, 5]):
        with DevicePool(model.kv_spec(16), 10, device="cpu") as pool:
            results.append(ModelRunner(model, pool).prefill(ids, 0, pages))
    assert torch.equal(*results)


def test_before_layer_runs_before_each_layers_attention(tiny_models) -> None:
    model = tiny_models[torch.float32]
    calls: list[int] = []
    with DevicePool(model.kv_spec(16), 4, device="cpu") as pool:
        def hook(layer: int) -> None:
            chunk = calls.count(0) - (layer > 0)  # chunks of 16 tokens: 0, 1, 2
            first_slot = (chunk, 0)  # (page, offset) of the chunk's first token
            assert not pool.kv[0, layer][first_slot].any()  # this layer: not written yet
            if layer:
                assert pool.kv[0, layer - 1][first_slot].any()  # previous layer: written
            calls.append(layer)

        ModelRunner(model, pool, before_layer=hook).prefill(tokens(40), 0, [0, 1, 2])
    assert calls == [0, 1] * 3  # three 16-token chunks, two layers each


def test_prefill_resumes_exactly_where_it_stopped(tiny_models) -> None:
    """Prefilling [0, 32) then [32, 50) equals one prefill of [0, 50) with the same chunks."""
    model = tiny_models[torch.float32]
    ids = tokens(50)
    with DevicePool(model.kv_spec(16), 4, device="cpu") as pool:
        whole = ModelRunner(model, pool).prefill(ids, 0, [0, 1, 2, 3], all_logits=True)
    with DevicePool(model.kv_spec(16), 4, device="cpu") as pool:
        runner = ModelRunner(model, pool)
        first = runner.prefill(ids[:32], 0, [0, 1], all_logits=True)
        rest = runner.prefill(ids, 32, [0, 1, 2, 3], all_logits=True)
    assert torch.equal(torch.cat([first, rest]), whole)


def test_kv_lands_in_page_slots(tiny_models) -> None:
    model = tiny_models[torch.float32]
    with DevicePool(model.kv_spec(4), 8, device="cpu") as pool:
        ModelRunner(model, pool).prefill(tokens(6), 0, [5, 2])
        written = pool.kv.abs().sum(dim=(0, 1, 4, 5)) > 0  # (page, offset)
    expected = torch.zeros(8, 4, dtype=torch.bool)
    expected[5, :] = True
    expected[2, :2] = True
    assert torch.equal(written, expected)


def test_usage_errors_say_what_to_do(tiny_models) -> None:
    model = tiny_models[torch.float32]
    with DevicePool(model.kv_spec(16), 2, device="cpu") as pool:
        runner = ModelRunner(model, pool)
        with pytest.raises(CacheUsageError, match="allocate pages first"):
            runner.prefill(tokens(40), 0, [0, 1])
        with pytest.raises(CacheUsageError, match="outside the pool"):
            runner.prefill(tokens(10), 0, [7])
        with pytest.raises(CacheUsageError, match="nothing to prefill"):
            runner.prefill(tokens(10), 10, [0])
        with pytest.raises(ConfigError, match="multiple of the page size"):
            ModelRunner(model, pool, chunk_tokens=24)
        with pytest.raises(ConfigError, match="new tokens"):
            model(torch.tensor([1, 2]), [SeqChunk([0], 0, 3)], pool)
    other = load_tiny_model(torch.float32, "cpu", config=tiny_config(num_layers=3))
    wrong = DevicePool(other.kv_spec(16), 2, device="cpu")
    with pytest.raises(ConfigError, match="model.kv_spec"):
        ModelRunner(model, wrong)
    with pytest.raises(CacheUsageError, match="beyond the model"):
        with DevicePool(model.kv_spec(16), 1, device="cpu") as pool:
            model(torch.tensor([1]), [SeqChunk([0] * 300, 4096, 1)], pool)


def test_decode_batch_matches_single_decodes(tiny_models) -> None:
    """Batched decode equals one-at-a-time decode up to matmul rounding (row count differs)."""
    model = tiny_models[torch.float32]
    prompts = [tokens(n, seed=n) for n in (5, 17, 33)]
    with DevicePool(model.kv_spec(16), 12, device="cpu") as pool:
        runner = ModelRunner(model, pool)
        tables = [pool.allocator.alloc(pages_for(len(p) + 1, 16)) for p in prompts]
        firsts = [int(runner.prefill(p, 0, t).argmax()) for p, t in zip(prompts, tables)]
        seqs = [(t, len(p)) for p, t in zip(prompts, tables)]
        batch = runner.decode(firsts, seqs)
        single = torch.cat([runner.decode([f], [s]) for f, s in zip(firsts, seqs)])
    torch.testing.assert_close(batch, single, atol=1e-5, rtol=1e-5)
    assert torch.equal(batch.argmax(-1), single.argmax(-1))


def test_usable_prefix_stays_on_the_chunk_grid_in_deterministic_mode(tiny_models) -> None:
    model = tiny_models[torch.float32]
    with DevicePool(model.kv_spec(16), 2, device="cpu") as pool:
        by_page = ModelRunner(model, pool, deterministic=True)
        by_two = ModelRunner(model, pool, chunk_tokens=32, deterministic=True)
        assert by_page.usable_prefix(48, 100) == 48 and by_two.usable_prefix(48, 100) == 32
        assert by_page.usable_prefix(64, 64) == 48  # the last token is always computed
        assert by_page.usable_prefix(0, 1) == 0


def test_usable_prefix_ends_on_any_page_by_default(tiny_models) -> None:
    model = tiny_models[torch.float32]
    with DevicePool(model.kv_spec(16), 2, device="cpu") as pool:
        runner = ModelRunner(model, pool, chunk_tokens=64)
        assert runner.usable_prefix(48, 100) == 48  # off the 64-token chunk grid
        assert runner.usable_prefix(50, 100) == 48  # whole pages only
        assert runner.usable_prefix(64, 64) == 48  # the last token is always computed


def test_pool_on_another_device_is_refused(tiny_models) -> None:
    model = tiny_models[torch.float32]
    with DevicePool(model.kv_spec(16), 2, device="meta") as pool:
        with pytest.raises(ConfigError, match="same device"):
            ModelRunner(model, pool)
