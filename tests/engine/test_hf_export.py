"""SmolLM2's converted GGUF exported as a Hugging Face directory: kvtier reads back the config
and tokenizer it converted, transformers loads the directory and runs it as kvtier does, an
export is written once and again when its conversion changes, and what a Llama config cannot
describe is refused."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from kvtier.engine.batch import SeqChunk
from kvtier.engine.hf_dir import HFModelDir
from kvtier.engine.hf_export import (MARKER, check_exportable, ensure_hf_export, export_dir,
                                     smollm2_hf_dir)
from kvtier.engine.model import PagedLlama
from kvtier.engine.model_config import tiny_hybrid_config
from kvtier.engine.tokenizer import Tokenizer
from kvtier.engine.weights import ensure_converted, load_config
from kvtier.errors import ConfigError
from kvtier.tiers.device_pool import DevicePool

transformers = pytest.importorskip("transformers")

CHATS = ([{"role": "user", "content": "What is 2+2?"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi  "},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Ü 12345?"}])


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """SmolLM2 converted into a cache of this module's own (a few seconds)."""
    return ensure_converted(tmp_path_factory.mktemp("kvtier-cache"))


@pytest.fixture(scope="module")
def exported(converted) -> Path:
    return ensure_hf_export(converted)


def clone(converted: Path, where: Path, **changes) -> Path:
    """A converted directory sharing `converted`'s weights and tokenizer (hard links), its
    config.json with top-level `changes`."""
    where.mkdir()
    for name in ("model.safetensors", "tokenizer.json"):
        os.link(converted / name, where / name)
    meta = json.loads((converted / "config.json").read_text())
    (where / "config.json").write_text(json.dumps({**meta, **changes}))
    return where


def test_kvtier_reads_back_the_converted_model(converted, exported):
    assert exported == export_dir(converted) == converted.parent / f"{converted.name}-hf"
    assert smollm2_hf_dir(converted.parent) == exported  # the module's cache root
    source = HFModelDir(str(exported))
    assert dataclasses.replace(source.config(), name="x") == \
        dataclasses.replace(load_config(converted), name="x")
    ours, theirs = source.tokenizer(), Tokenizer.from_files(converted)
    for field in ("bos_token_id", "eos_token_id", "stop_token_ids", "special_tokens"):
        assert getattr(ours.special, field) == getattr(theirs.special, field), field
    template = json.loads((converted / "config.json").read_text())["chat_template"]
    assert ours.chat_template.source == template["source"]
    assert ours.chat_template.special_tokens == template["special_tokens"]
    for chat in CHATS:  # the GGUF's template renders as kvtier's ChatML with its system prompt
        assert ours.encode_chat(chat) == theirs.encode_chat(chat)
    for name in ("model.safetensors", "tokenizer.json"):  # links, not copies
        assert (exported / name).stat().st_ino == (converted / name).stat().st_ino


def test_transformers_loads_the_directory(converted, exported):
    config = transformers.AutoConfig.from_pretrained(exported)
    assert config.model_type == "llama" and config.dtype == torch.bfloat16
    assert (config.num_key_value_heads, config.head_dim) == (3, 64)
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    assert isinstance(tokenizer, transformers.PreTrainedTokenizerFast)
    ours = HFModelDir(str(exported)).tokenizer()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    for chat in CHATS:
        text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert text == ours.apply_chat_template(chat)
        assert tokenizer(text)["input_ids"] == ours.encode_chat(chat)  # nothing added
        assert tokenizer.decode(ours.encode_chat(chat)) == text


def test_transformers_runs_it_as_kvtier_runs_the_conversion(converted, exported):
    """The logits of transformers' LlamaForCausalLM over the export equal kvtier's over the
    converted weights: the config means to transformers what it means to kvtier."""
    from kvtier.engine.weights import load_state_dict

    reference = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    reference.eval()
    model = PagedLlama.from_state_dict(load_config(converted), load_state_dict(converted),
                                       torch.float32, "cpu")
    tokens = torch.tensor(Tokenizer.from_files(converted).encode_chat(CHATS[0]))
    with DevicePool(model.kv_spec(16), 4, "cpu") as pool:
        ours = model(tokens, [SeqChunk(list(range(3)), 0, len(tokens))], pool, all_logits=True)
    with torch.no_grad():
        theirs = reference(tokens[None]).logits[0].float()
    assert torch.allclose(ours, theirs, atol=1e-3, rtol=1e-3), (ours - theirs).abs().max()


def test_written_once_and_again_when_the_conversion_changes(converted, tmp_path):
    source = clone(converted, tmp_path / "m")
    target = ensure_hf_export(source)
    before = (target / "config.json").stat()
    assert ensure_hf_export(source) == target  # current: nothing rewritten
    after = (target / "config.json").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    meta = json.loads((source / "config.json").read_text())
    meta["source"] = {**meta["source"], "size": meta["source"]["size"] + 1}  # another GGUF
    (source / "config.json").write_text(json.dumps(meta))
    assert ensure_hf_export(source) == target
    assert (target / "config.json").stat().st_ino != before.st_ino
    assert json.loads((target / MARKER).read_text())["source"] == meta["source"]
    assert not [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith(".")]  # temps


def test_what_a_llama_config_cannot_describe_is_refused(converted, tmp_path):
    gemma = clone(converted, tmp_path / "gemma", model=tiny_hybrid_config().to_dict())
    with pytest.raises(ConfigError, match="architecture='gemma3' has no Hugging Face"):
        ensure_hf_export(gemma)
    assert not export_dir(gemma).exists()
    config = load_config(converted)
    with pytest.raises(ConfigError, match="attention_bias=True"):
        check_exportable(dataclasses.replace(config, attention_bias=True))
    with pytest.raises(ConfigError, match="embed_scale=2.0"):
        check_exportable(dataclasses.replace(config, embed_scale=2.0))
    with pytest.raises(ConfigError, match="not a converted GGUF's"):
        ensure_hf_export(export_dir(converted))  # a HF directory is not a conversion
    with pytest.raises(ConfigError, match="no readable config.json"):
        ensure_hf_export(tmp_path / "nowhere")
