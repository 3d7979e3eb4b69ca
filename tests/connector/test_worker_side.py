"""The connector's worker half, without vLLM: copies between CPU-layout blocks and L2."""
from __future__ import annotations

import torch

from kvtier.connector.plan import PageLoad, PageSave, StepPlan
from kvtier.connector.worker_side import WorkerSide

LAYERS, BLOCKS, HEADS, BS, HD = 3, 6, 2, 4, 8


def kv_caches(seed: int) -> dict[str, torch.Tensor]:
    """vLLM's CPU layout: one buffer, a [blocks, heads, block_size, 2 x head_dim] slice per
    layer, named as vLLM names them (registered out of order on purpose)."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn(LAYERS, BLOCKS, HEADS, BS, 2 * HD, generator=gen).to(torch.bfloat16)
    return {f"model.layers.{i}.self_attn.attn": buf[i] for i in (2, 0, 1)}


def test_blocks_round_trip_through_l2_into_other_blocks():
    src, dst = kv_caches(0), kv_caches(1)
    a, b = (WorkerSide(caches, num_slots=4, block_size=BS) for caches in (src, dst))
    b.host = a.host  # one rank's pool seen by a second engine's blocks
    a.begin_step(StepPlan())
    report = a.end_step(StepPlan(saves=(PageSave((1, 4), (3, 0)),)))
    assert report.saved == {3, 0} and not report.failed_saves
    b.begin_step(StepPlan(loads=(PageLoad("r", (3, 0), (5, 2)),)))
    for name in src:
        assert torch.equal(dst[name][5], src[name][1]) and torch.equal(dst[name][2], src[name][4])
    assert b.end_step(StepPlan()).failed_loads == frozenset()
    saved, loaded = a.take_stats(), b.take_stats()
    page = LAYERS * HEADS * BS * 2 * HD * 2  # bf16
    assert (saved.backup_tokens, saved.backup_bytes, saved.hit_tokens) == (2 * BS, 2 * page, 0)
    assert (loaded.hit_tokens, loaded.load_back_bytes) == (2 * BS, 2 * page)
    assert saved.backup_seconds > 0 and loaded.load_back_seconds > 0
    assert a.take_stats().empty  # taken once


def test_host_pool_keeps_a_head_and_part_contiguous_over_layers():
    src = kv_caches(2)
    w = WorkerSide(src, num_slots=2)
    w.end_step(StepPlan(saves=(PageSave((3,), (1,)),)))
    head, part = 1, 1  # values of head 1: the second half of its [block_size, 2 x hd] bytes
    run = w.host[1, head, part]
    assert run.is_contiguous()
    for i in range(LAYERS):
        layer = src[f"model.layers.{i}.self_attn.attn"]
        assert torch.equal(run[i], layer[3, head].reshape(-1)[BS * HD:])


def test_a_load_that_fails_is_reported_with_its_blocks():
    w = WorkerSide(kv_caches(3), num_slots=2, block_size=BS)
    w.begin_step(StepPlan(loads=(PageLoad("r", (0, 7), (1, 2)),)))  # slot 7 does not exist
    assert w.end_step(StepPlan()).failed_loads == {0, 7}
    assert w.take_stats().failed_load_tokens == 2 * BS
    assert w.take_failed_blocks() == {1, 2} and w.take_failed_blocks() == set()


def test_a_kv_cache_in_another_layout_is_refused():
    import pytest

    from kvtier.errors import ConfigError

    gpu_like = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, BLOCKS, BS, HEADS, HD)
                for i in range(LAYERS)}  # FlashAttention's [2, blocks, block_size, heads, dim]
    with pytest.raises(ConfigError, match="not supported yet"):
        WorkerSide(gpu_like, num_slots=2, expected=(BLOCKS, HEADS, BS, HD))
    WorkerSide(kv_caches(4), num_slots=2, expected=(BLOCKS, HEADS, BS, HD))  # vLLM's CPU one
