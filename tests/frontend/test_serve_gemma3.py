"""`kvtier serve --model gemma3-270m`: Gemma-3 270M behind the real serve graph answers a chat
completion in Gemma's chat format, as the same model answers in-process; TP above 1 is
refused (one KV head)."""
from __future__ import annotations

import argparse

import pytest
import requests
from shared_serve import BASE, greedy_chat, in_process_answer, served

from kvtier.engine.gemma3_package import Gemma3Weights
from kvtier.errors import ConfigError
from kvtier.frontend.settings import ModelChoice, ServeSettings
from kvtier.cli.serve_command import add_arguments, settings_from

pytestmark = pytest.mark.timeout(300)


def test_settings_take_the_alias_and_refuse_tp_2() -> None:
    s = ServeSettings(model="gemma3-270m")
    assert s.model is ModelChoice.GEMMA3_270M and s.served_model_name == "gemma-3-270m"
    with pytest.raises(ConfigError, match="one KV head"):
        ServeSettings(model="gemma3-270m", tp_size=2)


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    settings = settings_from(parser.parse_args([
        "--model", "gemma3-270m", "--instances", "1", "--page-size", "16", "--chunk-tokens",
        "64", "--device-pages", "64", "--max-new-tokens", "16", "--dtype", "fp32",
        "--l3-root", str(tmp_path_factory.mktemp("l3"))]))
    with served(settings):
        yield settings


def test_a_chat_completion_is_gemmas_answer(app) -> None:
    messages = [{"role": "user", "content": "Name the capital of France."}]
    body = greedy_chat("gemma-3-270m", messages, 8)
    source = Gemma3Weights()
    tok = source.tokenizer()
    prompt = tok.encode_chat(messages)
    assert tok.decode(prompt, skip_special_tokens=False).startswith("<bos><start_of_turn>user\n")
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["choices"][0]["message"]["content"] == in_process_answer(source, tok, prompt, 8)
    models = requests.get(f"{BASE}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == ["gemma-3-270m"]
