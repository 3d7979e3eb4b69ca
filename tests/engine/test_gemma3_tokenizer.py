"""Gemma-3's SentencePiece tokenizer rebuilt from its GGUF, its special tokens, and the Gemma
chat template kvtier builds in (the GGUF carries none)."""
from __future__ import annotations

import pytest

from kvtier.engine.chat_template import GEMMA_TEMPLATE, ChatTemplate

# Reference ids from transformers' own GGUF tokenizer converter on the same file
# (AutoTokenizer.from_pretrained(dir, gguf_file=...), a GemmaTokenizer), recorded once: it
# takes ~20 s to run. Digits one by one, byte fallback, runs of spaces and tabs, user-defined
# and control tokens, no dummy prefix space.
GOLDEN = {
    "What is the capital of France? 12345 3.14159":
        [3689, 563, 506, 5279, 529, 7001, 236881, 236743, 236770, 236778, 236800, 236812,
         236810, 236743, 236800, 236761, 236770, 236812, 236770, 236810, 236819],
    "  two  spaces,   three\ttab\t\ttabs":
        [138, 13498, 138, 35220, 236764, 139, 19891, 255968, 4823, 255969, 39218],
    "naïve café, 日本語, emoji 🙂🚀, Ελληνικά 𝔘𝔫𝔦":
        [1789, 238527, 560, 33443, 236764, 33375, 238582, 236764, 64334, 57235, 242015, 236764,
         23883, 109959, 42220, 236743, 478, 395, 386, 390, 478, 395, 386, 409, 254865],
    "newlines\nand\n\nparagraphs\n": [208697, 107, 624, 108, 141217, 107],
    "<start_of_turn>user\nI'm sure <b>they've</b> won't<end_of_turn>\n":
        [105, 2364, 107, 236777, 236789, 236757, 2889, 236743, 200, 20890, 236789, 560, 209,
         2810, 236789, 236745, 106, 107],
    "def f(x):\n    return x**2  # ünïcödé\x00":
        [2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865,
         174898, 238527, 236755, 55515, 236859, 238],
}


@pytest.fixture(scope="module")
def tok(gemma3_tokenizer):
    return gemma3_tokenizer


@pytest.mark.parametrize("text", list(GOLDEN))
def test_encode_matches_transformers(tok, text: str) -> None:
    assert tok.encode(text) == GOLDEN[text]


@pytest.mark.parametrize("text", list(GOLDEN))
def test_decoding_gives_the_text_back(tok, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()  # byte pieces too
    step = tok.decode_stream(skip_special_tokens=False)
    assert "".join(step(i) for i in ids) == text


def test_gemmas_own_special_tokens(tok) -> None:
    assert [tok.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>", "<start_of_turn>",
                                         "<end_of_turn>")] == [0, 1, 2, 105, 106]
    assert (tok.special.bos_token_id, tok.eos_token_id) == (2, 1)
    assert set(tok.stop_token_ids) == {1, 106}  # a chat turn ends with <end_of_turn>
    assert tok.vocab_size == 262144


def test_a_prompt_starts_with_one_bos(tok) -> None:
    assert tok.encode_prompt("Hi") == [2, 10979]
    assert tok.encode_prompt("<bos>Hi") == [2, 10979]
    assert tok.encode("Hi") == [10979]  # pieces of one prompt concatenate without it


def test_the_chat_template_is_gemmas(tok) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
                {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    assert tok.apply_chat_template(messages) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello!<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode_chat(messages[1:2])
    assert ids == [2, 105, 2364, 107, 10979, 106, 107, 105, 4368, 107]


def test_the_template_refuses_roles_out_of_turn() -> None:
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match="alternate"):
        ChatTemplate(GEMMA_TEMPLATE, {"bos_token": "<bos>"}).render(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
