"""bench prefix: its figures and targets, driven end to end with the tiny model."""
from __future__ import annotations

import pytest
import torch

from kvtier.bench.prefix import (QUESTION, BenchModel, PrefixBenchParams, check_targets,
                                 params_from_args, reusable_tokens, run, targets)
from kvtier.cli.main import build_parser
from kvtier.engine import load_tiny_model
from kvtier.errors import ConfigError

PARAMS = PrefixBenchParams(tokens=200, dtype="fp32", page_size=32, chunk_tokens=64, new_tokens=4)


class ByteTokenizer:
    """The tiny model's 256-token vocabulary as bytes: enough for the bench's prompts."""

    stop_token_ids = ()

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    encode_prompt = encode  # no BOS

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode(errors="replace")


def tiny(dtype: torch.dtype) -> BenchModel:
    return BenchModel(load_tiny_model(dtype, "cpu"), ByteTokenizer(), "tiny")


def test_command_line_defaults_are_the_engines():
    parse = build_parser().parse_args
    assert params_from_args(parse(["bench", "prefix", "--json"])) == PrefixBenchParams()
    assert PrefixBenchParams().chunk_tokens is None and PrefixBenchParams().tokens == 2000
    ns = parse(["bench", "prefix", "--deterministic", "--chunk-tokens", "256", "--tokens", "999"])
    assert params_from_args(ns) == PrefixBenchParams(tokens=999, chunk_tokens=256,
                                                     deterministic=True)


def test_reusable_tokens_are_the_documents_whole_pages():
    assert reusable_tokens(2000, 64) == 1984
    assert reusable_tokens(2048, 64) == 2048
    assert reusable_tokens(63, 64) == 0


def test_targets_and_checks():
    bounds = targets(1984, deterministic=False)
    assert bounds == {"l1": 0.10, "l2": 0.15, "l3": 0.25, "cold_vs_deterministic": 0.6,
                      "reused_tokens_min": 1984}
    ratios = {"l1": 0.05, "l2": 0.2, "l3": 0.25, "cold_vs_deterministic": 0.5}
    reused = {"l1": 1984, "l2": 2048, "l3": 1920}
    assert check_targets(bounds, ratios, reused) == {
        "l1": True, "l2": False, "l3": True, "cold_vs_deterministic": True,
        "reused_tokens_min": False}
    assert "cold_vs_deterministic" not in targets(1984, deterministic=True)


def test_default_mode_run_with_the_tiny_model():
    out = run(PARAMS, load=tiny)
    prompt = 200 + len(QUESTION.encode())
    whole_pages = (prompt - 1) // 32 * 32  # a hit leaves the last token to compute
    assert out["mode"] == "default" and out["chunk_tokens"] == 64
    assert out["prompt_tokens"] == prompt and out["document_tokens"] == 200
    assert out["reusable_tokens"] == 192
    assert out["reused_tokens"] == {"l1": whole_pages, "l2": whole_pages, "l3": whole_pages}
    assert out["cached_tokens"]["l2"] == {"device": 0, "host": whole_pages, "storage": 0, "peer": 0}
    assert out["cached_tokens"]["l3"] == {"device": 0, "host": 0, "storage": whole_pages, "peer": 0}
    assert out["target_checks"]["reused_tokens_min"]
    # The same pages' bytes and the same forwards in every tier: bit-identical hits.
    assert out["identical"] and out["logits_identical"]
    assert set(out["lengths"]) == {"cold", "cold_deterministic", "l1", "l2", "l3"}
    assert out["ttft_cold_deterministic_s"] > 0
    assert out["meets_targets"] == all(out["target_checks"].values())
    assert set(out["target_checks"]) == set(out["targets"])


def test_deterministic_mode_hits_equal_the_cold_run():
    out = run(PARAMS._replace(deterministic=True), load=tiny)
    assert out["mode"] == "deterministic" and out["chunk_tokens"] == 32
    assert out["equal_to_cold"] and out["logits_equal_to_cold"]  # invariant 1
    assert out["ttft_cold_deterministic_s"] == out["ttft_cold_s"]
    assert "cold_vs_deterministic" not in out["targets"]
    assert "cold_deterministic" not in out["lengths"]
    assert out["target_checks"]["reused_tokens_min"]


def test_bad_sizes_are_refused_before_loading():
    def no_load(dtype):
        raise AssertionError("loaded")

    with pytest.raises(ConfigError, match="multiple"):
        run(PARAMS._replace(chunk_tokens=40), load=no_load)
    with pytest.raises(ConfigError, match="below one page"):
        run(PARAMS._replace(tokens=10), load=no_load)


def test_a_model_directory(tmp_path):
    """--model DIR: a tiny random Llama checkpoint with SmolLM2's tokenizer."""
    import json
    import shutil

    from kvtier.bench.prefix import loader
    from kvtier.engine.weights import ensure_converted

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=49152, max_position_embeddings=1024,
                                      tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path)
    shutil.copy(ensure_converted() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    ns = build_parser().parse_args(["bench", "prefix", "--model", str(tmp_path)])
    assert params_from_args(ns).model == str(tmp_path)
    # 300 tokens: the prompt passes the default 256-token prefetch threshold
    out = run(PARAMS._replace(model=str(tmp_path), tokens=300), load=loader(str(tmp_path)))
    assert out["model"].startswith(tmp_path.name + "-")  # name and weights digest
    assert out["identical"] and out["reused_tokens"]["l3"] >= out["reusable_tokens"], out


def test_a_gguf_file_is_a_model():
    """--model FILE.gguf: SmolLM2's own GGUF by path, keyed by its name and file digest."""
    from kvtier.bench.prefix import loader
    from kvtier.engine.gguf_source import find_gguf

    path = str(find_gguf())
    ns = build_parser().parse_args(["bench", "prefix", "--model", path])
    assert params_from_args(ns).model == path
    bench_model = loader(path)(torch.float32)
    from kvtier.engine.gguf_file import GGUFFile

    assert bench_model.name == GGUFFile(path).identity().replace(" ", "-") != "smollm2"
    assert len(bench_model.name.rsplit("-", 1)[1]) == 16  # the file's digest
    assert bench_model.tokenizer.vocab_size == 49152
    assert bench_model.model.config.num_kv_heads == 3


def test_gemma3_270m_past_its_window():
    """--model gemma3-270m: a 600-token document (past the 512-token sliding window) hit from
    every tier, each hit the L1 hit's answer."""
    from kvtier.bench.prefix import loader

    ns = build_parser().parse_args(["bench", "prefix", "--model", "gemma3-270m"])
    assert params_from_args(ns).model == "gemma3-270m"
    params = PARAMS._replace(model="gemma3-270m", tokens=600, page_size=64, chunk_tokens=128,
                             new_tokens=2)
    out = run(params, load=loader("gemma3-270m"))
    assert out["model"].startswith("Gemma-3-270m-")  # its name and the GGUF's digest
    assert out["identical"] and out["logits_identical"], out
    assert out["reused_tokens"] == {"l1": 576, "l2": 576, "l3": 576}, out


def test_sglang_cache_flags_reach_the_measured_engine():
    parse = build_parser().parse_args
    ns = parse(["bench", "prefix", "--page-size", "32", "--hicache-mem-layout",
                "page_first_direct", "--hicache-write-policy", "write_back"])
    params = params_from_args(ns)
    assert params.page_size == 32
    assert params.hicache == (("mem_layout", "page_first_direct"), ("write_policy", "write_back"))
    for argv, words in ((["--hicache-host-mode", "storage_only"], "host-mode"),
                        (["--disable-hierarchical-cache"], "hierarchical"),
                        (["--hicache-storage-backend", "mooncake"], "storage-backend")):
        with pytest.raises(ConfigError, match=words):
            params_from_args(parse(["bench", "prefix", *argv]))
    out = run(PARAMS._replace(hicache=params.hicache), load=tiny)
    assert out["hicache"] == {"mem_layout": "page_first_direct", "write_policy": "write_back"}
    assert out["identical"] and out["reused_tokens"]["l3"] >= out["reusable_tokens"], out
