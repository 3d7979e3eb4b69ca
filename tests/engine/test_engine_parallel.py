"""TP sharding hooks: ranks as threads with an in-process all-reduce give TP=1's greedy tokens.

Real TP (torch.distributed, one process per rank) is built on the same `TensorParallel`;
this checks the sharding arithmetic: heads and MLP split by rank, row-parallel sums.
"""
from __future__ import annotations

import threading

import pytest
import torch
from reference_generate import generate

from kvtier.engine import (SamplingParams, TensorParallel, load_tiny_model, random_state_dict,
                           tiny_config)


class ThreadAllReduce:
    """Sum over `size` threads, in rank order so every rank gets the same bits."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size, timeout=30)
        self.parts: list[torch.Tensor | None] = [None] * size

    def for_rank(self, rank: int):
        def reduce(x: torch.Tensor) -> None:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            total = self.parts[0].clone()
            for part in self.parts[1:]:
                total += part
            self.barrier.wait()  # nobody overwrites a part before all have summed
            x.copy_(total)
        return reduce


PROMPTS = [torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
           for n in (9, 30)]
PARAMS = SamplingParams(max_new_tokens=8)


def threaded_tp_tokens(size: int, dtype: torch.dtype = torch.float32,
                       prompts: list[list[int]] = PROMPTS,
                       params: SamplingParams = PARAMS) -> dict[int, list[list[int]]]:
    """Greedy tokens of the tiny model at TP=`size`, ranks as threads; by rank."""
    reducer = ThreadAllReduce(size)
    results: dict[int, list[list[int]]] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            tp = TensorParallel(rank, size, reduce_fn=reducer.for_rank(rank))
            model = load_tiny_model(dtype, "cpu", tp=tp)
            assert model.kv_spec(16).num_kv_heads == 6 // size  # each rank caches its heads only
            results[rank] = [g.tokens for g in generate(model, prompts, params)]
        except BaseException as exc:  # surfaced below; a dead rank would hang the others
            errors.append(exc)
            reducer.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.fixture(scope="module")
def tp1_tokens() -> list[list[int]]:
    return [g.tokens for g in generate(load_tiny_model(torch.float32, "cpu"), PROMPTS, PARAMS)]


@pytest.mark.parametrize("size", [2, 6])
def test_sharded_ranks_agree_with_tp1(size: int, tp1_tokens: list[list[int]]) -> None:
    results = threaded_tp_tokens(size)
    assert all(results[r] == tp1_tokens for r in range(size))


def test_tp3_threads_match_tp1_in_fp32(tp1_tokens: list[list[int]]) -> None:
    """TP=3, which SmolLM2-135M needs and the old 4-KV-head tiny model could not split."""
    results = threaded_tp_tokens(3)
    assert sorted(results) == [0, 1, 2]
    assert all(results[r] == tp1_tokens for r in range(3))
    assert all(len(t) == PARAMS.max_new_tokens for t in tp1_tokens)


def test_shards_partition_the_weights() -> None:
    config = tiny_config()
    state = random_state_dict(config)
    q = state["model.layers.0.self_attn.q_proj.weight"]
    down = state["model.layers.0.mlp.down_proj.weight"]
    ranks = [TensorParallel(r, 2) for r in range(2)]
    assert torch.equal(torch.cat([tp.rows(q) for tp in ranks]), q)
    assert torch.equal(torch.cat([tp.cols(down) for tp in ranks], dim=1), down)
