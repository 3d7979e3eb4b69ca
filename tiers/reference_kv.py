"""Deterministic stand-in KV for a token prefix, for demos and tests of the tiers.

The KV of a page depends on the whole prefix up to that page (as real attention KV does), so
it is derived from the page's chain hash. Writing it into L1 and checking it after any tier
round trip proves that a hit returns exactly the bytes a recomputation would produce.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

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


class ReferenceRequest(NamedTuple):
    """What `serve_reference` did: the released lookup, the L3 hit and whether the KV the
    cache handed back was the reference's (a hit must never be wrong KV)."""

    lookup: Any  # CacheLookup
    storage_hit: int  # tokens prefetched from L3
    kv_ok: bool

    def lengths(self):
        return self.lookup.lengths(self.storage_hit)


def serve_reference(cache: Any, tokens: Sequence[int]) -> ReferenceRequest | None:
    """One request through a HierarchicalCache as a model would run it, with reference KV:
    prefetch from L3 (waiting per the policy), look up and load back, check the KV handed
    back, write the rest, store. None when L1 cannot hold the request (nothing is held)."""
    storage_hit = 0
    ticket = cache.prefetch(tokens)
    if ticket is not None:  # a scheduler would serve other requests while this waits
        while not cache.prefetch_ready(ticket):
            ticket.op._settled.wait(0.001)
        storage_hit = cache.finish_prefetch(ticket)
    spec = cache.spec
    lookup = cache.lookup(tokens)
    fresh = cache.allocate(-(-len(tokens) // spec.page_size) - len(lookup.device_pages))
    if fresh is None:
        cache.abort(lookup)
        return None
    for layer in range(spec.num_layers):  # what the forward does before each attention
        cache.wait_layer(layer)
    kv_ok = prefix_kv_matches(cache.device_pool.kv, spec, tokens[: lookup.cached_len],
                              lookup.device_pages)
    write_prefix_kv(cache.device_pool.kv, spec, tokens, fresh, first_page=len(lookup.device_pages))
    cache.finish(lookup, tokens, lookup.device_pages + fresh)
    return ReferenceRequest(lookup, storage_hit, kv_ok)
