"""Tokenizers rebuilt from GGUF metadata: GPT-2 style byte-level BPE (SmolLM2) and
SentencePiece BPE (Gemma-3, kvtier.engine.sentencepiece_bpe), their special tokens and chat
templates."""
from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

from kvtier.errors import ConfigError

if TYPE_CHECKING:
    from kvtier.engine.chat_template import ChatTemplate

_CONTROL = 3  # llama.cpp token type of control (special) tokens
GEMMA_BOS, GEMMA_EOS, GEMMA_END_OF_TURN = "<bos>", "<eos>", "<end_of_turn>"
GGUF_PRE_TOKENIZERS = ("smollm",)  # tokenizer.ggml.pre values build_from_gguf rebuilds
# The default system message inside the Jinja template; "\n" may be escaped or literal there.
_SYSTEM_IN_TEMPLATE = re.compile(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", re.S)


@dataclass(frozen=True)
class SpecialTokens:
    """Ids the engine needs; stored beside tokenizer.json in the converted cache's config.json."""

    bos_token_id: int | None
    eos_token_id: int
    stop_token_ids: tuple[int, ...]
    default_system_prompt: str | None = None
    special_tokens: tuple[str, ...] = field(default=())
    add_bos: bool = False  # a prompt starts with bos_token_id (Gemma's do)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "SpecialTokens":
        return cls(bos_token_id=data["bos_token_id"], eos_token_id=data["eos_token_id"],
                   stop_token_ids=tuple(data["stop_token_ids"]),
                   default_system_prompt=data.get("default_system_prompt"),
                   special_tokens=tuple(data.get("special_tokens", ())),
                   add_bos=bool(data.get("add_bos", False)))


def check_gguf_tokenizer(meta: Mapping[str, Any]) -> None:
    """Refuse a GGUF tokenizer that `build_from_gguf` would not rebuild exactly."""
    model = meta.get("tokenizer.ggml.model")
    if model == "llama" and meta.get("general.architecture") == "gemma3":
        return  # SentencePiece BPE with byte fallback (kvtier.engine.sentencepiece_bpe)
    if model != "gpt2":
        raise ConfigError(f"tokenizer model {model!r} is not supported; kvtier rebuilds GPT-2 "
                          f"style byte-level BPE ('gpt2') and Gemma-3's SentencePiece BPE "
                          f"('llama' in a gemma3 GGUF)")
    pre = meta.get("tokenizer.ggml.pre")
    if pre not in GGUF_PRE_TOKENIZERS:
        raise ConfigError(f"the GGUF's pre-tokenizer {pre!r} is not supported; kvtier rebuilds "
                          f"{', '.join(map(repr, GGUF_PRE_TOKENIZERS))} (SmolLM, SmolLM2) from a "
                          f"GGUF; for another model give its Hugging Face directory "
                          f"(tokenizer.json)")


def gguf_chat_template(meta: Mapping[str, Any]) -> dict[str, Any] | None:
    """The GGUF's chat template (tokenizer.chat_template) and the special tokens it may name
    (bos_token, eos_token, unk_token, pad_token); None when it has none."""
    source = meta.get("tokenizer.chat_template")
    if (not isinstance(source, str) or not source) and \
            meta.get("general.architecture") == "gemma3":
        from kvtier.engine.chat_template import GEMMA_TEMPLATE

        return {"source": GEMMA_TEMPLATE, "special_tokens": {"bos_token": GEMMA_BOS}}
    if not isinstance(source, str) or not source:
        return None
    tokens = meta["tokenizer.ggml.tokens"]
    names = {}
    for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                      ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            names[name] = str(tokens[int(token_id)])
    return {"source": source, "special_tokens": names}


def build_from_gguf(meta: Mapping[str, Any]) -> tuple[Any, SpecialTokens]:
    """A `tokenizers.Tokenizer` and the special ids from `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    check_gguf_tokenizer(meta)
    if meta.get("tokenizer.ggml.model") == "llama":
        return _build_gemma(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                               fuse_unk=False, byte_fallback=False))
    # SmolLM's pre-tokenizer (llama.cpp pre type "smollm"): every digit on its own, then the
    # GPT-2 regex; no prefix space. The same as HF's tokenizer.json for SmolLM2.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [t for t, kind in zip(tokens, types) if kind == _CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])

    eos = int(meta["tokenizer.ggml.eos_token_id"])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    stop = [eos]
    end_of_text = vocab.get("<|endoftext|>")
    if end_of_text is not None and end_of_text != eos:
        stop.append(end_of_text)  # a base-model style end also ends a chat turn
    template = str(meta.get("tokenizer.chat_template", ""))
    m = _SYSTEM_IN_TEMPLATE.search(template)
    return tok, SpecialTokens(bos_token_id=None if bos is None else int(bos), eos_token_id=eos,
                              stop_token_ids=tuple(stop),
                              default_system_prompt=m.group(1) if m else None,
                              special_tokens=tuple(specials))


def _build_gemma(meta: Mapping[str, Any]) -> tuple[Any, SpecialTokens]:
    """Gemma's SentencePiece tokenizer; its special ids read from the vocabulary itself (GGUF
    files of Gemma have been seen with bos = eos = unk = pad = 1 in their metadata)."""
    from kvtier.engine.sentencepiece_bpe import build_sentencepiece

    tok, specials = build_sentencepiece(meta)
    ids = {}
    for name in (GEMMA_BOS, GEMMA_EOS, GEMMA_END_OF_TURN):
        token_id = tok.token_to_id(name)
        if token_id is None:
            raise ConfigError(f"the gemma3 GGUF's vocabulary lacks {name}; it is not a Gemma-3 "
                              f"tokenizer")
        ids[name] = token_id
    return tok, SpecialTokens(bos_token_id=ids[GEMMA_BOS], eos_token_id=ids[GEMMA_EOS],
                              stop_token_ids=(ids[GEMMA_EOS], ids[GEMMA_END_OF_TURN]),
                              special_tokens=tuple(specials), add_bos=True)


def apply_chat_template(messages: Sequence[Mapping[str, str]], add_generation_prompt: bool = True,
                        default_system_prompt: str | None = None) -> str:
    """ChatML text: `<|im_start|>role\\ncontent<|im_end|>\\n` per message.

    Mirrors SmolLM2's template: a default system message is prepended when the first
    message is not a system message and `default_system_prompt` is given.
    """
    parts = []
    if default_system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        parts.append(f"<|im_start|>system\n{default_system_prompt}<|im_end|>\n")
    for message in messages:
        parts.append(f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


@functools.cache
def _byte_level_chars() -> dict[str, int]:
    """Byte-level BPE's alphabet: the character that stands for each byte (printable Latin-1
    bytes stand for themselves, the others for 256, 257, ... in byte order), reversed."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)}
    chars, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + shifted)] = byte
            shifted += 1
    return chars


class Tokenizer:
    """Text <-> token ids, plus the chat template and the stop tokens of the model."""

    def __init__(self, backend: Any, special: SpecialTokens,
                 chat_template: "ChatTemplate | None" = None) -> None:
        self._tok = backend
        self.special = special
        self.chat_template = chat_template  # the model's own (Jinja); None: ChatML

    @classmethod
    def load(cls, tokenizer_json: Path, special: SpecialTokens,
             chat_template: "ChatTemplate | None" = None) -> "Tokenizer":
        from tokenizers import Tokenizer as Backend

        return cls(Backend.from_file(str(tokenizer_json)), special, chat_template)

    @classmethod
    def from_files(cls, cache_dir: Path) -> "Tokenizer":
        """From a converted cache directory (tokenizer.json + config.json)."""
        config = json.loads((cache_dir / "config.json").read_text())
        return cls.load(cache_dir / "tokenizer.json", SpecialTokens.from_dict(config["tokenizer"]))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int:
        return self.special.eos_token_id

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        return self.special.stop_token_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes token `token_id` stands for (a byte-level BPE token may hold part of a
        character; decoding it alone would not give them)."""
        from kvtier.engine.sentencepiece_bpe import piece_bytes

        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            return b""
        if getattr(self._tok.model, "byte_fallback", False):  # SentencePiece: <0xAB>, '▁'
            return piece_bytes(piece)
        if type(self._tok.decoder).__name__ == "ByteLevel":
            table = _byte_level_chars()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        return self._tok.decode([int(token_id)], skip_special_tokens=False).encode()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their ids. No BOS is
        added (pieces of one prompt concatenate): `encode_prompt` starts a whole prompt."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A whole prompt's ids: `encode(text)`, after the BOS token when the model starts
        every sequence with one (Gemma) and the text does not already."""
        ids = self.encode(text)
        bos = self.special.bos_token_id
        if self.special.add_bos and bos is not None and ids[:1] != [bos]:
            ids.insert(0, bos)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_stream(self, skip_special_tokens: bool = True) -> Callable[[int], str]:
        """A step function for one output: each token id in, the text it completes out ("" while
        a character is unfinished). Incremental (tokenizers' DecodeStream): constant work per
        token where decoding the whole output again grows with its length."""
        from tokenizers.decoders import DecodeStream

        stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(self._tok, int(token_id)) or ""

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        if self.chat_template is not None:
            return self.chat_template.render(messages, add_generation_prompt)
        return apply_chat_template(messages, add_generation_prompt,
                                   self.special.default_system_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        return self.encode_prompt(self.apply_chat_template(messages, add_generation_prompt))

    def save(self, tokenizer_json: Path) -> None:
        self._tok.save(str(tokenizer_json))
