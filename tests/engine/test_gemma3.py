"""Gemma-3: the paged model against transformers' Gemma3ForCausalLM (eager attention, fp32, the
same weights), on prompts longer than the sliding window, prefilled in chunks and decoded past
the window; the window mask itself; Gemma-3 270M's weights read from its GGUF."""
from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from engine_helpers import hf_gemma3, pages_for

from kvtier.engine import ModelRunner, SeqChunk, chunk_bounds
from kvtier.engine.architectures import build_model
from kvtier.engine.batch import ForwardBatch, attention_mask, window_start
from kvtier.engine.model_config import LayerKind, tiny_hybrid_config
from kvtier.engine.weights import random_state_dict
from kvtier.errors import ConfigError
from kvtier.tiers.device_pool import DevicePool


def tokens(n: int, vocab: int, seed: int = 0) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class PagedRun(NamedTuple):
    rows: list[int]  # the positions whose logits were kept
    logits: torch.Tensor  # (len(rows), vocab)
    tokens: list[int]  # greedy: after the prompt, then after each decode step


def paged_run(model, ids: list[int], steps: int, page_size: int, chunk: int,
              every_row: bool = True) -> PagedRun:
    """Prefill `ids` in chunks, then `steps` greedy decode steps; the logits of every prompt
    position (or of each chunk's last), then of each decode step."""
    need = pages_for(len(ids) + steps, page_size)
    with DevicePool(model.kv_spec(page_size), need + 2, device="cpu") as pool:
        runner = ModelRunner(model, pool, chunk)
        pages = list(reversed(range(2, need + 2)))  # page ids need not be in order
        if every_row:
            rows, logits = list(range(len(ids))), [runner.prefill(ids, 0, pages, all_logits=True)]
        else:  # the same chunks, one call each: only their last rows go through the LM head
            bounds = chunk_bounds(0, len(ids), chunk)
            rows = [hi - 1 for _, hi in bounds]
            logits = [runner.prefill(ids[:hi], lo, pages)[None] for lo, hi in bounds]
        out = [int(logits[-1][-1].argmax())]
        for i in range(steps):
            logits.append(runner.decode([out[-1]], [(pages, len(ids) + i)]))
            rows.append(len(ids) + i)
            out.append(int(logits[-1][-1].argmax()))
    return PagedRun(rows, torch.cat(logits), out)


def check_against_hf(model, hf, ids: list[int], steps: int, page_size: int, chunk: int,
                     atol: float, every_row: bool = True) -> None:
    run = paged_run(model, ids, steps, page_size, chunk, every_row)
    with torch.no_grad():
        ref = hf(torch.tensor([ids + run.tokens[:steps]]),
                 logits_to_keep=torch.tensor(run.rows)).logits[0].float()
    assert run.logits.shape == ref.shape
    torch.testing.assert_close(run.logits, ref, atol=atol, rtol=1e-3)
    assert run.logits.argmax(-1).tolist() == ref.argmax(-1).tolist()


def test_the_window_mask_hides_keys_window_or_more_back() -> None:
    mask = attention_mask(SeqChunk([0, 1, 2], 8, 4), torch.device("cpu"), window=5)
    for i, q in enumerate(range(8, 12)):
        assert mask[i].tolist() == [0 <= q - k < 5 for k in range(12)]
    # decode: one query, keys beyond the window masked; within it, no mask at all
    assert attention_mask(SeqChunk([0, 1], 9, 1), torch.device("cpu"), 5)[0].tolist() == \
        [k > 4 for k in range(10)]
    assert attention_mask(SeqChunk([0], 4, 1), torch.device("cpu"), 5) is None
    assert [window_start(q, 5) for q in (0, 4, 5, 9)] == [0, 0, 1, 5]


def test_a_sliding_layer_reads_only_the_pages_its_window_reaches() -> None:
    """8 new tokens at 96..103, a 40-token window over 16-token pages: the first query sees
    keys from 57 on, in page 3; FULL layers read all 7 pages."""
    table = [9, 8, 7, 6, 5, 4, 3]
    (view,) = ForwardBatch([SeqChunk(table, 96, 8)], 16, 10, torch.device("cpu"), 40).views
    assert (view.full.first, view.full.pages.tolist(), view.full.length) == (0, table, 104)
    assert (view.window.first, view.window.pages.tolist(), view.window.length) == \
        (48, table[3:], 56)
    assert torch.equal(view.window.mask, attention_mask(SeqChunk(table, 96, 8),
                                                        torch.device("cpu"), 40)[:, 48:])


def test_tiny_hybrid_matches_hf_transformers_past_the_window() -> None:
    config = tiny_hybrid_config()
    state = random_state_dict(config, seed=1)
    model = build_model(config, state, torch.float32, "cpu")
    assert model.layer_kinds.count(LayerKind.SLIDING) == 3
    # 100 prompt tokens (2.5 windows) in 16-token chunks, then 4 decodes further past it
    check_against_hf(model, hf_gemma3(config, state), tokens(100, config.vocab_size), 4,
                     page_size=8, chunk=16, atol=1e-4)


def test_the_window_changes_the_answer() -> None:
    """Not a no-op: the same weights with a window covering the whole prompt differ."""
    config = tiny_hybrid_config()
    state = random_state_dict(config, seed=1)
    wide = tiny_hybrid_config(sliding_window=4096)
    ids = tokens(100, config.vocab_size)
    narrow_logits = paged_run(build_model(config, state), ids, 0, 8, 16).logits
    wide_logits = paged_run(build_model(wide, state), ids, 0, 8, 16).logits
    assert torch.equal(narrow_logits[:40], wide_logits[:40])  # inside the window: the same
    assert not torch.allclose(narrow_logits[40:], wide_logits[40:], atol=1e-3)


def test_tiny_hybrid_splits_over_tp_2_and_gemma3_270m_refuses_it(gemma3) -> None:
    from kvtier.engine.parallel import TensorParallel

    TensorParallel(0, 2).check(tiny_hybrid_config())
    with pytest.raises(ConfigError, match="TP size 2 does not divide the 1 KV heads"):
        TensorParallel(0, 2).check(gemma3[0])


def test_gemma3_270m_config_from_its_gguf(gemma3) -> None:
    config, state, _ = gemma3
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.head_dim, config.intermediate_size, config.vocab_size) == \
        (18, 640, 4, 1, 256, 2048, 262144)
    assert [i for i, k in enumerate(config.layer_kinds) if k is LayerKind.FULL] == [5, 11, 17]
    assert (config.sliding_window, config.rope_theta, config.rope_local_theta) == \
        (512, 1e6, 1e4)
    assert config.scale == 256 ** -0.5 and config.embed_scale == 640 ** 0.5
    # llama.cpp stores Gemma's norms as 1 + w; the converter gives HF's w back
    norm = state["model.layers.0.self_attn.k_norm.weight"]
    assert norm.shape == (256,) and -2.0 < float(norm.mean()) < 2.0


def test_gemma3_270m_matches_hf_transformers_past_the_window(gemma3, gemma3_model) -> None:
    config, state, tok = gemma3
    text = " ".join(f"Item {i}: the {['red', 'blue', 'green'][i % 3]} box holds {i * 7 % 50} "
                    f"stones." for i in range(80))
    ids = tok.encode_prompt(text)[:700]
    assert len(ids) == 700 and ids[0] == tok.special.bos_token_id
    check_against_hf(gemma3_model, hf_gemma3(config, state), ids, 3, page_size=16, chunk=128,
                     atol=2e-3, every_row=False)


def test_gemma3_270m_knows_a_capital(gemma3, gemma3_model) -> None:
    """The weights are read right (norm offsets, no Q/K permutation): a fact comes out."""
    tok = gemma3[2]
    for prompt, answer in (("The capital of Germany is Berlin. The capital of France is",
                            " Paris"), ("The Eiffel Tower is in the city of", " Paris")):
        run = paged_run(gemma3_model, tok.encode_prompt(prompt), 1, page_size=16, chunk=16,
                        every_row=False)
        assert tok.decode(run.tokens).startswith(answer)


def test_a_gemma3_gguf_by_path_is_the_same_model(gemma3) -> None:
    """`--model FILE.gguf` of a gemma3 file: accepted from its header, the same config and
    identity (name and SHA-256) as the packaged alias."""
    from kvtier.engine.gemma3_package import Gemma3Weights, assembled_gguf
    from kvtier.engine.gguf_file import GGUFFile
    from kvtier.frontend import served_model
    from kvtier.frontend.settings import ModelChoice, ServeSettings

    path = str(assembled_gguf())
    settings = ServeSettings(model=path)
    assert settings.model is ModelChoice.PATH
    assert settings.served_model_name == "gemma-3-270m-q4_k_m"
    source = served_model.weight_source(settings)
    assert source == GGUFFile(path) and source.config() == gemma3[0]
    assert source.identity() == Gemma3Weights().identity()
    assert source.identity().endswith("-a5fd3b62230aa5ec")  # the package's published SHA-256


def test_a_mixed_forward_matches_one_sequence_at_a_time(tiny_hybrid_models) -> None:
    """One forward with a prefill piece past the window beside decodes inside and past it
    (each sequence its own window span) equals the sequences' forwards one by one."""
    model = tiny_hybrid_models[torch.float32]
    prompts = [tokens(n, 256, seed=n) for n in (20, 70, 100)]
    with DevicePool(model.kv_spec(16), 24, device="cpu") as pool:
        runner = ModelRunner(model, pool, 16)
        tables = [pool.allocator.alloc(pages_for(len(p) + 1, 16)) for p in prompts]
        for p, t in zip(prompts[:2], tables):
            runner.prefill(p, 0, t)
        runner.prefill(prompts[2][:64], 0, tables[2])
        seqs = [SeqChunk(tables[0], 20, 1), SeqChunk(tables[1], 70, 1), SeqChunk(tables[2], 64, 36)]
        new = [[7], [9], prompts[2][64:]]
        mixed = runner.forward([t for n in new for t in n], seqs)
        single = torch.cat([runner.forward(n, [s]) for n, s in zip(new, seqs)])
    torch.testing.assert_close(mixed, single, atol=1e-5, rtol=1e-5)
    assert torch.equal(mixed.argmax(-1), single.argmax(-1))
