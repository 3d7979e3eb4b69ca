"""SmolLM2's tokenizer rebuilt from GGUF metadata, and the chat template."""
from __future__ import annotations

import pytest

from kvtier.engine import Tokenizer, apply_chat_template

# Reference ids from transformers' own GGUF tokenizer converter on the same file
# (AutoTokenizer.from_pretrained(..., gguf_file=...)), recorded once: it takes ~25 s to run.
GOLDEN = {
    "What is the capital of France? 12345 héllo  world\n\nThe   end.<|im_end|>":
        [1780, 314, 260, 3575, 282, 4649, 47, 216, 33, 34, 35, 36, 37, 294, 2756, 31394, 216,
         905, 198, 198, 504, 256, 1112, 30, 2],
    "I'm sure they've 3.14159 won't": [57, 5248, 2090, 502, 3543, 216, 35, 30, 33, 36, 33, 37,
                                       41, 3763, 982],
    "  leading spaces\ttabs\r\n": [216, 2899, 5600, 197, 100, 7366, 2738],
}


@pytest.fixture(scope="module")
def tok(smollm2) -> Tokenizer:
    return smollm2.tokenizer


@pytest.mark.parametrize("text", list(GOLDEN))
def test_encode_matches_reference(tok: Tokenizer, text: str) -> None:
    assert tok.encode(text) == GOLDEN[text]


@pytest.mark.parametrize("text", ["def f(x):\n    return x**2  # 😀 ünïcödé", "", " a  b ",
                                  "<|im_start|>user\nhi<|im_end|>"])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_special_tokens(tok: Tokenizer) -> None:
    assert tok.token_to_id("<|im_start|>") == 1 and tok.token_to_id("<|im_end|>") == 2
    assert tok.eos_token_id == 2 and set(tok.stop_token_ids) == {0, 2}
    assert tok.vocab_size == 49152
    assert tok.decode([1, 4093, 2]) == "user"  # specials skipped by default


def test_chat_template(tok: Tokenizer) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                "Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?"
                "<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages) == expected
    ids = tok.encode_chat(messages)
    assert ids[0] == 1 and ids[-4:] == [1, 520, 9531, 198]  # ... <|im_start|>assistant\n
    system = [{"role": "system", "content": "Be brief."}] + messages
    assert tok.apply_chat_template(system, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n")
    assert apply_chat_template(messages) == (
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
