"""SentencePiece-BPE tokenizers (GGUF `tokenizer.ggml.model` "llama": Gemma, Llama 2) rebuilt
with the `tokenizers` package from the GGUF's tokens, scores and token types.

SentencePiece's BPE merges, at each step, the adjacent pair whose concatenation is the
highest-scoring vocabulary piece. A `tokenizers` BPE does the same when its merges are every
(left, right) split of every piece, ranked by the piece's score (ties by id): the conversion
transformers' SentencePieceExtractor makes. Characters outside the vocabulary fall back to
their UTF-8 bytes (<0xAB> pieces); ' ' becomes '\u2581'; no dummy prefix space unless the GGUF
asks for one (tokenizer.ggml.add_space_prefix). Control tokens are special; user-defined ones
(Gemma's '\\n', runs of spaces and tabs, HTML tags) are matched whole before BPE, as llama.cpp
matches them.
"""
from __future__ import annotations

import re
from typing import Any, Mapping

NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6  # llama.cpp token types
SPACE = "\u2581"
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def merges_from_scores(tokens: list[str], scores: list[float], types: list[int]
                       ) -> list[tuple[str, str]]:
    """Every split of every normal piece into two normal pieces, best merged score first."""
    normal = {t: i for i, (t, kind) in enumerate(zip(tokens, types)) if kind == NORMAL}
    merges = []
    for piece, i in normal.items():
        local = [(piece[:k], piece[k:]) for k in range(1, len(piece))
                 if piece[:k] in normal and piece[k:] in normal]
        local.sort(key=lambda m: (normal[m[0]], normal[m[1]]))
        merges.extend((-scores[i], i, pos, m) for pos, m in enumerate(local))
    merges.sort(key=lambda m: m[:3])
    return [m[3] for m in merges]


def build_sentencepiece(meta: Mapping[str, Any]) -> tuple[Any, list[str]]:
    """A `tokenizers.Tokenizer` from `tokenizer.ggml.*` metadata, and its special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    tokens: list[str] = [str(t) for t in meta["tokenizer.ggml.tokens"]]
    scores = [float(s) for s in meta["tokenizer.ggml.scores"]]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [NORMAL] * len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_scores(tokens, scores, types),
                               dropout=None, fuse_unk=True, byte_fallback=True,
                               unk_token=None if unk_id is None else tokens[int(unk_id)]))
    steps = [normalizers.Replace(" ", SPACE)]
    if meta.get("tokenizer.ggml.add_space_prefix", True):  # llama.cpp's default for SPM
        steps.insert(0, normalizers.Prepend(SPACE))
    tok.normalizer = normalizers.Sequence(steps)
    tok.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(),
                                     decoders.Fuse()])
    specials = [t for t, kind in zip(tokens, types) if kind == CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    return tok, specials


def piece_bytes(piece: str) -> bytes:
    """The bytes a SentencePiece piece stands for (<0xAB> is one byte; '\u2581' a space)."""
    m = _BYTE_PIECE.match(piece)
    return bytes([int(m.group(1), 16)]) if m else piece.replace(SPACE, " ").encode()
