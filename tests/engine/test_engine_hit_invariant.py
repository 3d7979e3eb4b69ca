"""docs/architecture.md invariant 1 for the engine: a request resuming from cached prefix
pages gives bit-identical logits and greedy tokens to a cold run prefilling in the same
page-aligned chunks."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_identical, hit_and_cold

DTYPES = [torch.float32, torch.bfloat16]


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("pages_per_chunk", [1, 2])
def test_tiny_hit_is_bit_identical(tiny_models, dtype, page_size, pages_per_chunk) -> None:
    chunk = page_size * pages_per_chunk
    # The shared prefix ends mid-chunk: with 2-page chunks its last whole page is off the
    # grid, so only the part on the grid is reused (ModelRunner.usable_prefix).
    prefix = tokens(2 * chunk + page_size + page_size // 2, seed=1)
    hit, cold = hit_and_cold(tiny_models[dtype], prefix, tokens(30, 2), tokens(21, 3),
                             page_size, chunk)
    assert_identical(hit, cold)


def test_tiny_hit_with_narrower_pool_dtype(tiny_models) -> None:
    """A float32 model over a bfloat16 pool: still identical, since keys are always read back."""
    hit, cold = hit_and_cold(tiny_models[torch.float32], tokens(40, 1), tokens(9, 2),
                             tokens(13, 3), 16, 16, kv_dtype=torch.bfloat16)
    assert_identical(hit, cold)


def test_tiny_corrupt_hit_is_detected(tiny_models) -> None:
    """The comparison is sensitive: a tiny change in one cached value changes the logits."""
    hit, cold = hit_and_cold(tiny_models[torch.float32], tokens(40, 1), tokens(9, 2),
                             tokens(13, 3), 16, 16, corrupt_hit=True)
    assert not torch.equal(hit.logits[0], cold.logits[0])


@pytest.fixture(scope="module")
def document(smollm2) -> list[int]:
    tok = smollm2.tokenizer
    text = ("Kvtier keeps the KV cache of shared prompt prefixes in three tiers: the device pool, "
            "host memory and a storage backend. A request whose prefix is cached skips that part "
            "of the prefill and only computes the rest of its prompt. ")
    return tok.encode_chat([{"role": "user", "content": text * 2}], add_generation_prompt=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [16, 64])
def test_smollm2_hit_is_bit_identical(smollm2, smollm2_model, document, dtype, page_size) -> None:
    tok = smollm2.tokenizer
    prefix = document[:page_size + 8] if page_size == 64 else document[:40]
    question = lambda q: tok.encode_chat([{"role": "user", "content": q}])[-12:]  # noqa: E731
    hit, cold = hit_and_cold(smollm2_model(dtype), prefix, question("Summarize it."),
                             question("What are the tiers?"), page_size, page_size, steps=2)
    assert_identical(hit, cold)
