"""A GGUF file given by path (`--model FILE.gguf`): SmolLM2's packaged GGUF loaded that way is
the built-in `smollm2` model (config, weights, tokenizer, chat prompt, greedy tokens); its
identity adds the digest of the file's bytes; settings resolve it; what kvtier does not run is
refused by name, before anything is converted."""
from __future__ import annotations

import argparse
import hashlib

import numpy as np
import pytest
import torch
from reference_generate import generate

from kvtier.engine import PagedLlama, SamplingParams
from kvtier.engine import weights as weights_module
from kvtier.engine.gguf_file import GGUFFile
from kvtier.engine.gguf_source import find_gguf, read_header
from kvtier.engine.weight_sources import SmolLM2Weights
from kvtier.errors import ConfigError
from kvtier.frontend import served_model
from kvtier.frontend.settings import ModelChoice, ServeSettings

gguf = pytest.importorskip("gguf")

CHATS = ([{"role": "user", "content": "Hi there"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q"},
          {"role": "assistant", "content": "A"}, {"role": "user", "content": "Ü? 12345"}])


@pytest.fixture(scope="module")
def packaged() -> GGUFFile:
    """SmolLM2's GGUF by path: converted once into the user's cache (~15 s), then < 1 s."""
    source = GGUFFile(str(find_gguf()))
    source.directory()
    return source


def test_the_packaged_gguf_by_path_is_smollm2(packaged, smollm2) -> None:
    assert packaged.config() == smollm2.config
    state = packaged.state_dict()
    assert state.keys() == smollm2.state_dict.keys()
    assert all(torch.equal(state[k], v) for k, v in smollm2.state_dict.items())
    ours, alias = packaged.tokenizer(), smollm2.tokenizer
    assert ours.chat_template is not None  # the GGUF's own Jinja template ...
    assert ours.special == alias.special
    text = "Sensor log.\nRecord 12: room 3 read 57 degrees <|im_end|> ünïcode"
    assert ours.encode(text) == alias.encode(text)
    for messages in CHATS:  # ... renders as the built-in model's ChatML prompt
        for gen in (True, False):
            assert ours.apply_chat_template(messages, gen) == \
                alias.apply_chat_template(messages, gen)


def test_the_same_greedy_tokens_as_smollm2(packaged, smollm2, smollm2_model) -> None:
    prompt = smollm2.tokenizer.encode_chat([{"role": "user", "content": "Name a colour."}])
    params = SamplingParams(max_new_tokens=8, stop_token_ids=())
    model = PagedLlama.from_state_dict(packaged.config(), packaged.state_dict(), torch.float32,
                                       "cpu")
    ours = generate(model, [prompt], params)[0].tokens
    assert len(ours) == 8 and ours == generate(smollm2_model(torch.float32), [prompt],
                                               params)[0].tokens


def test_identity_is_the_name_and_the_files_digest(packaged, smollm2, monkeypatch) -> None:
    """By design the built-in smollm2 model's namespace is its name alone (it is always the
    packaged file); a GGUF given by path adds the SHA-256 of its bytes, so two files of one
    architecture never share a page."""
    digest = hashlib.sha256(find_gguf().read_bytes()).hexdigest()
    assert packaged.digest() == digest
    assert packaged.identity() == f"{smollm2.config.name}-{digest[:16]}"
    assert not hasattr(SmolLM2Weights(), "identity")  # the ranks key it by config name

    def no_convert(*args, **kwargs):
        raise AssertionError("a converted file must not be converted again")

    monkeypatch.setattr(weights_module, "_convert", no_convert)
    assert GGUFFile(str(find_gguf())).identity() == packaged.identity()


def test_settings_take_a_gguf_file(packaged) -> None:
    from kvtier.cli.serve_command import add_arguments, settings_from

    path = str(find_gguf())
    s = ServeSettings(model=path)
    assert s.model is ModelChoice.PATH and s.model_path == path
    assert s.served_model_name == "SmolLM2-135M-Instruct.Q4_1"
    named = ServeSettings(model="path", model_path=path)
    assert (named.model, named.model_path) == (ModelChoice.PATH, path)
    assert ServeSettings.from_mapping(s.to_mapping()).model_path == path
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert settings_from(parser.parse_args(["--model", path])).model_path == path
    assert served_model.weight_source(s) == packaged
    assert served_model.tokenizer(s).encode("Hi") == packaged.tokenizer().encode("Hi")


def write_gguf(path, arch: str = "llama", pre: str = "smollm", tokenizer: str = "gpt2",
               tensors: tuple[str, ...] = ("token_embd.weight",), **keys) -> str:
    """A small GGUF file: `keys` are GGUFWriter add_* calls (sliding_window=4096, ...)."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("toy")
    w.add_block_count(1)
    w.add_tokenizer_model(tokenizer)
    w.add_tokenizer_pre(pre)
    w.add_token_list(["a", "b", "c", "d"])
    for key, value in keys.items():
        getattr(w, f"add_{key}")(value)
    for name in tensors:
        w.add_tensor(name, np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("kind, match", [
    ("qwen2", "architecture 'qwen2' is not supported"),
    ("gemma3-27b", "Gemma-3 27B scales attention by hidden/heads"),
    ("sliding", "sliding-window attention"),
    ("experts", "mixture of experts"),
    ("rope_freqs", "scales RoPE"),
    ("bias", "unexpected GGUF tensor 'blk.0.attn_q.bias'"),
    ("llama-bpe", "pre-tokenizer 'llama-bpe' is not supported"),
    ("spm", "tokenizer model 'llama' is not supported"),
])
def test_what_kvtier_does_not_run_is_refused_by_name(tmp_path, kind, match) -> None:
    path = tmp_path / f"{kind}.gguf"
    write_gguf(path, **{
        "qwen2": dict(arch="qwen2"), "gemma3-27b": dict(arch="gemma3", embedding_length=5376),
        "sliding": dict(sliding_window=4096),
        "experts": dict(expert_count=8), "rope_freqs": dict(tensors=("rope_freqs.weight",)),
        "bias": dict(tensors=("blk.0.attn_q.bias",)), "llama-bpe": dict(pre="llama-bpe"),
        "spm": dict(tokenizer="llama")}[kind])
    with pytest.raises(ConfigError, match=match):
        ServeSettings(model=str(path))


def test_the_converter_refuses_too(tmp_path) -> None:
    """A rank given the file directly (no settings check) fails before writing a cache."""
    path = write_gguf(tmp_path / "g.gguf", arch="qwen2")
    with pytest.raises(ConfigError, match="'qwen2' is not supported"):
        GGUFFile(path, cache_dir=str(tmp_path / "cache")).config()
    assert not list((tmp_path / "cache" / "gguf").glob("g-*"))


def test_a_missing_or_damaged_file_is_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such GGUF file"):
        ServeSettings(model=str(tmp_path / "absent.gguf"))
    with pytest.raises(ConfigError, match="no such GGUF file"):
        GGUFFile(str(tmp_path / "absent.gguf")).config()
    (tmp_path / "text.gguf").write_text("not a model")
    with pytest.raises(ConfigError, match="not a GGUF file"):
        ServeSettings(model=str(tmp_path / "text.gguf"))
    (tmp_path / "cut.gguf").write_bytes(find_gguf().read_bytes()[:4096])
    with pytest.raises(ConfigError, match="truncated or damaged"):
        ServeSettings(model=str(tmp_path / "cut.gguf"))


def test_the_header_is_the_readers_metadata(tmp_path) -> None:
    path = write_gguf(tmp_path / "h.gguf", sliding_window=7, context_length=99)
    header = read_header(tmp_path / "h.gguf")
    reader = gguf.GGUFReader(path)
    assert header.tensor_names == tuple(t.name for t in reader.tensors)
    scalars = {k: f.contents() for k, f in reader.fields.items()
               if not k.startswith("GGUF.") and not isinstance(f.contents(), list)}
    assert header.metadata == scalars
    assert header.metadata["llama.attention.sliding_window"] == 7
