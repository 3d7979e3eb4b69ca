"""`kvtier serve --model DIR`: a Hugging Face directory that is not SmolLM2's GGUF (a tiny
random Llama made here with transformers, SmolLM2's tokenizer.json and a chat template of its
own) behind the real serve graph, with SGLang's cache flags. Its answers equal the same
checkpoint run in-process, its template shapes the prompt, and its L3 namespace carries the
weights' digest."""
from __future__ import annotations

import argparse
import json
import shutil

import pytest
import requests
import torch
from shared_serve import BASE, greedy_chat, in_process_answer, served

from kvtier.engine.hf_dir import HFModelDir
from kvtier.engine.weights import ensure_converted
from kvtier.errors import ConfigError
from kvtier.frontend.settings import ModelChoice, ServeSettings
from kvtier.cli.serve_command import add_arguments, settings_from

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

KEY = "model-dir-admin-key-0123456789"
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}"
            "{{ raise_exception('this model takes no system message') }}{% endif %}"
            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
            "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\nSure: ' }}{% endif %}")


def make_checkpoint(path, seed: int) -> None:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=49152,
                                      max_position_embeddings=1024, rms_norm_eps=1e-5,
                                      tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path)
    shutil.copy(ensure_converted() / "tokenizer.json", path / "tokenizer.json")
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|im_end|>"}))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "tiny-llama"
    make_checkpoint(path, seed=3)
    return path


@pytest.fixture(scope="module")
def app(model_dir):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from(parser.parse_args([
        "--model", str(model_dir), "--instances", "1", "--page-size", "16", "--chunk-tokens",
        "64", "--device-pages", "96", "--max-new-tokens", "32", "--dtype", "fp32",
        "--admin-key", KEY, "--hicache-mem-layout", "page_first_direct",
        "--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
        json.dumps({"root_dir": str(model_dir.parent / "l3")})]))
    with served(settings):
        yield settings


def test_settings_take_a_directory(model_dir, tmp_path):
    s = ServeSettings(model=str(model_dir))
    assert s.model is ModelChoice.PATH and s.model_path == str(model_dir)
    assert s.served_model_name == "tiny-llama"
    assert ServeSettings.from_mapping(s.to_mapping()).model_path == str(model_dir)
    with pytest.raises(ConfigError, match="no config.json"):
        ServeSettings(model=str(tmp_path))
    with pytest.raises(ConfigError, match="only for model 'path'"):
        ServeSettings(model="tiny", model_path=str(model_dir))
    assert ServeSettings(model="path", model_path=str(model_dir)).model_path == str(model_dir)
    for bad in ("smolm2", "a\x00b"):  # a typo, a name no file system takes
        with pytest.raises(ConfigError, match="not smollm2, tiny"):
            ServeSettings(model=bad)


def test_answers_equal_the_checkpoint_in_process(app, model_dir):
    messages = [{"role": "user", "content": "Name three colours."}]
    body = greedy_chat("tiny-llama", messages, 12)
    source = HFModelDir(str(model_dir))
    tok = source.tokenizer()
    prompt = tok.encode_chat(messages)
    assert tok.decode(prompt).endswith("assistant\nSure: ")  # the directory's own template
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["message"]["content"] == in_process_answer(source, tok, prompt, 12)
    refused = requests.post(f"{BASE}/v1/chat/completions", timeout=60, json={
        "model": "tiny-llama", "messages": [{"role": "system", "content": "x"}] + messages})
    assert refused.status_code == 400 and "no system message" in refused.text
    models = requests.get(f"{BASE}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["tiny-llama"]


def test_the_namespace_carries_the_weights_digest(app, model_dir):
    r = requests.get(f"{BASE}/admin/config", headers={"Authorization": f"Bearer {KEY}"},
                     timeout=30)
    (running,) = r.json()["instances"]
    # with L3 every layout becomes page_head (one contiguous run per KV head of a page)
    assert running["hicache"]["mem_layout"] == "page_head" and running["l3"] == "file"
    identity = HFModelDir(str(model_dir)).identity()
    assert running["model"] == identity and identity.startswith("tiny-llama-")
