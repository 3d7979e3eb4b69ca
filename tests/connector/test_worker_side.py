"""The connector's worker half, without vLLM: copies between vLLM's blocks (the CPU backend's
layout and the GPU backends') and L2."""
from __future__ import annotations

import pytest
import torch

from kvtier.connector.l3_traffic import TrafficResults
from kvtier.connector.plan import PageFetch, PageLoad, PageSave, StepPlan, Ticket
from kvtier.connector.worker_side import BlockLayout, WorkerSide, ordered_layers, ordered_names

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


def gpu_caches(layout: BlockLayout, logical: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per layer `[blocks, heads, 2, block_size, head_dim]` values, laid out as a GPU
    backend keeps them (as strided views of one buffer, as vLLM hands them over)."""
    out = {}
    for i, values in enumerate(logical):
        if layout is BlockLayout.KV_FIRST:  # [2, blocks, block_size, heads, dim]
            t = values.permute(2, 0, 3, 1, 4).contiguous()
        else:  # BLOCK_FIRST: [blocks, 2, block_size, heads, dim]
            t = values.permute(0, 2, 3, 1, 4).contiguous()
        out[f"model.layers.{i}.self_attn.attn"] = t
    return out


@pytest.mark.parametrize("layout", [BlockLayout.KV_FIRST, BlockLayout.BLOCK_FIRST])
def test_gpu_layouts_save_each_heads_keys_and_values_and_load_them_back(layout):
    """The GPU backends' layouts (told from the shape): a head's keys (values) of a block are
    its [block_size, head_dim] keys (values) in the host pool, whatever the layout, and a
    block loads back into another block of another engine bit for bit."""
    gen = torch.Generator().manual_seed(5)
    logical = [torch.randn(BLOCKS, HEADS, 2, BS, HD, generator=gen).to(torch.bfloat16)
               for _ in range(LAYERS)]
    src = gpu_caches(layout, logical)
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    a = WorkerSide(src, num_slots=3, block_size=BS, expected=(BLOCKS, HEADS, BS, HD))
    b = WorkerSide(dst, num_slots=3, block_size=BS, expected=(BLOCKS, HEADS, BS, HD))
    assert a.layout is b.layout is layout
    b.host = a.host
    a.end_step(StepPlan(saves=(PageSave((4, 1), (2, 0)),)))
    for i in range(LAYERS):
        for head in range(HEADS):
            for part in range(2):
                assert torch.equal(a.host[2, head, part, i], logical[i][4, head, part].flatten())
    b.begin_step(StepPlan(loads=(PageLoad("r", (2, 0), (0, 5)),)))
    back = [BlockLayout.parts(layout, t) for t in ordered_layers(dst)]
    for i in range(LAYERS):
        assert torch.equal(back[i][0], logical[i][4]) and torch.equal(back[i][5], logical[i][1])
        assert not back[i][1:5].any()  # nothing else written


def test_the_same_kv_gives_the_same_host_pages_in_both_gpu_layouts():
    gen = torch.Generator().manual_seed(6)
    logical = [torch.randn(BLOCKS, HEADS, 2, BS, HD, generator=gen) for _ in range(LAYERS)]
    pools = []
    for layout in (BlockLayout.KV_FIRST, BlockLayout.BLOCK_FIRST):
        w = WorkerSide(gpu_caches(layout, logical), num_slots=2,
                       expected=(BLOCKS, HEADS, BS, HD))
        w.end_step(StepPlan(saves=(PageSave((3, 0), (0, 1)),)))
        pools.append(w.host)
    assert torch.equal(*pools)


def test_a_kv_cache_in_an_unknown_layout_is_refused():
    from kvtier.errors import ConfigError

    mla_like = {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, BS, HD)
                for i in range(LAYERS)}  # one latent per token: no heads, no K/V
    with pytest.raises(ConfigError, match="attention backend is not supported"):
        WorkerSide(mla_like, num_slots=2, expected=(BLOCKS, HEADS, BS, HD))
    strided = {name: t.transpose(2, 3).contiguous().transpose(2, 3)
               for name, t in kv_caches(4).items()}  # the CPU shape, not its one run per head
    with pytest.raises(ConfigError, match="attention backend is not supported"):
        WorkerSide(strided, num_slots=2, expected=(BLOCKS, HEADS, BS, HD))
    cpu = WorkerSide(kv_caches(4), num_slots=2, expected=(BLOCKS, HEADS, BS, HD))
    assert cpu.layout is BlockLayout.CPU


def test_wait_layer_knows_every_layer_and_on_cpu_the_loads_landed_before_it():
    src = kv_caches(7)
    w = WorkerSide(src, num_slots=2, block_size=BS)
    assert sorted(w.layer_index.values()) == list(range(LAYERS))
    w.end_step(StepPlan(saves=(PageSave((2,), (0,)),)))
    w.begin_step(StepPlan(loads=(PageLoad("r", (0,), (5,)),)))
    for name in src:  # landed already: waiting changes nothing
        assert torch.equal(src[name][5], src[name][2])
        w.wait_layer(name)
    w.wait_layer("not.a.layer")  # a layer vLLM has and the connector does not: no wait


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_each_layer_loads_on_its_own_stream_and_lands_before_its_attention():
    """The load stream copies layer by layer; after `wait_layer(name)` the compute stream
    sees that layer's blocks, and the step's end waits for every layer."""
    gen = torch.Generator().manual_seed(8)
    logical = [torch.randn(BLOCKS, HEADS, 2, BS, HD, generator=gen).to(torch.bfloat16)
               for _ in range(LAYERS)]
    src = {k: v.cuda() for k, v in gpu_caches(BlockLayout.KV_FIRST, logical).items()}
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    a = WorkerSide(src, num_slots=3, block_size=BS, expected=(BLOCKS, HEADS, BS, HD))
    b = WorkerSide(dst, num_slots=3, block_size=BS, expected=(BLOCKS, HEADS, BS, HD))
    assert a.host.is_pinned()
    a.end_step(StepPlan(saves=(PageSave((4, 1), (2, 0)),)))
    b.host.copy_(a.host)
    b.begin_step(StepPlan(loads=(PageLoad("r", (2, 0), (0, 5)),)))
    for name in ordered_names(dst):
        b.wait_layer(name)
        i = b.layer_index[name]
        view = BlockLayout.KV_FIRST.parts(dst[name])
        assert torch.equal(view[0].cpu(), logical[i][4]) and torch.equal(view[5].cpu(),
                                                                          logical[i][1])
    assert b.end_step(StepPlan()).failed_loads == frozenset()


class ScriptedL3:
    """An L3 traffic whose results the test hands out."""

    def __init__(self) -> None:
        self.results = TrafficResults()

    def fetch(self, keys, slots, gen) -> None:
        pass

    def take(self) -> TrafficResults:
        out, self.results = self.results, TrafficResults()
        return out

    def close(self) -> None:
        pass


def test_a_late_report_of_an_earlier_fetch_never_lists_the_slot_under_the_new_page():
    """Slot 2 is fetched for page A (generation 1), then for page B (generation 2): when the
    first fetch's read lands last, the slot is not listed for peers, neither as A (its bytes
    are not A's now) nor as B with the sums of A's bytes."""
    from kvtier.tiers.peer_table import PeerTable, lookup

    w = WorkerSide(kv_caches(4), num_slots=4, block_size=BS)
    table = PeerTable(4, HEADS)
    w.lend(table)
    l3 = ScriptedL3()
    w.attach_l3(l3)  # type: ignore[arg-type]
    keys = ("a" * 64, "b" * 64)
    w.begin_step(StepPlan(fetches=(PageFetch(keys[:1], (2,), 1),)))
    w.begin_step(StepPlan(fetches=(PageFetch(keys[1:], (2,), 2),)))
    l3.results.fetched.append(Ticket(2, 1))
    report = w.end_step(StepPlan())
    assert report.fetched == (Ticket(2, 1),)  # reported as it came: the scheduler judges it
    rows = table.rows.view("u1")
    assert lookup(rows, HEADS, keys[:1]).pages == () and lookup(rows, HEADS, keys[1:]).pages == ()
    l3.results.fetched.append(Ticket(2, 2))
    w.end_step(StepPlan())
    assert lookup(table.rows.view("u1"), HEADS, keys[1:]).pages == (2,)
