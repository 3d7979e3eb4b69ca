"""Gemma's SentencePiece-BPE tokenizer (GGUF `tokenizer.ggml.model` "llama" in a gemma3 file)
rebuilt with the `tokenizers` package from the GGUF's tokens and token types.

A GGUF lists no merges: they are every (left, right) split of every vocabulary piece into two
pieces, best first. Gemma's best is earliest in the file (its scores do not follow the merge
order; transformers' GGUF converter found the same), ties by the longer left, then right,
piece. Characters outside the vocabulary fall back to their UTF-8 bytes (<0xAB> pieces);
' ' becomes '\u2581' and no dummy prefix space is added. Pieces of two or more spaces are stored
as real spaces and spelled back with '\u2581' (the model's own tokenizer looks them up so).
Control tokens are special; the other user-defined ones (Gemma's '\\n' runs, tabs, HTML tags)
are matched whole before BPE, as llama.cpp matches them.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6  # llama.cpp token types
SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def respelled(tokens: list[str]) -> list[str]:
    """Pieces made only of spaces spelled with '\u2581', as the normalized text has them."""
    return [SPACE * len(t) if t and not t.strip(" ") else t for t in tokens]


def merges_in_file_order(tokens: list[str]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces; a piece earlier in the file merges first."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for piece, i in vocab.items():
        merges.extend((i, -k, k - len(piece), piece[:k], piece[k:]) for k in range(1, len(piece))
                      if piece[:k] in vocab and piece[k:] in vocab)
    merges.sort(key=lambda m: m[:3])
    return [(m[3], m[4]) for m in merges]


def build_sentencepiece(meta: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """A `tokenizers.Tokenizer` from `tokenizer.ggml.*` metadata, and its special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens = respelled([str(t) for t in meta["tokenizer.ggml.tokens"]])
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                               merges=merges_in_file_order(tokens), dropout=None, fuse_unk=True,
                               byte_fallback=True,
                               unk_token=None if unk_id is None else tokens[int(unk_id)]))
    tok.normalizer = normalizers.Replace(" ", SPACE)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    specials = [t for t, kind in zip(tokens, types) if kind == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED and SPACE not in t])
    return tok, specials


def piece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for (<0xAB> is one byte; '\u2581' a space)."""
    m = _BYTE_PIECE.match(piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace(SPACE, " ").encode()
