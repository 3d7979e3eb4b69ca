"""Deterministic stand-in KV for a token prefix, for demos and tests of the tiers.

The KV of a page depends on the whole prefix up to that page (as real attention KV does), so
it is derived from the page's chain hash. Writing it into L1 and checking it after any tier
round trip proves that a hit returns exactly the bytes a recomputation would produce.
"""
from __future__ import annotations

from typing import Sequence

import torch

from kvtier.keys import page_hashes
from kvtier.kv_spec import KVSpec


def page_kv(spec: KVSpec, page_hash: str) -> torch.Tensor:
    """(2, L, page_size, H, D) values for the page whose chain hash is `page_hash`."""
    gen = torch.Generator().manual_seed(int(page_hash[:15], 16))
    shape = (2, spec.num_layers, spec.page_size, spec.num_kv_heads, spec.head_dim)
    return torch.randn(shape, generator=gen).to(spec.dtype)


def write_prefix_kv(kv: torch.Tensor, spec: KVSpec, tokens: Sequence[int],
                    pages: Sequence[int], first_page: int = 0) -> None:
    """Fill L1 `pages` (for pages `first_page`.. of `tokens`) with the prefix's KV.

    `kv` is a (2, L, num_pages, page_size, H, D) pool tensor. A trailing partial page is
    written too (its tail tokens are whatever the page's seed gives: unused by attention).
    """
    padded = list(tokens) + [0] * (-len(tokens) % spec.page_size)
    hashes = page_hashes(padded, spec.page_size)
    for i, page in enumerate(pages):
        kv[:, :, page] = page_kv(spec, hashes[first_page + i]).to(kv.device)


def prefix_kv_matches(kv: torch.Tensor, spec: KVSpec, tokens: Sequence[int],
                      pages: Sequence[int]) -> bool:
    """True when L1 `pages` hold exactly the KV of the whole pages of `tokens`."""
    hashes = page_hashes(tokens, spec.page_size)
    return all(torch.equal(kv[:, :, page].cpu(), page_kv(spec, h))
               for page, h in zip(pages, hashes))
