"""The worker half of the vLLM connector, free of vLLM: one TP rank's L2 host pool and the
copies a `StepPlan` asks for (docs/vllm.md).

vLLM's KV cache is its L1: one tensor per layer, laid out as its attention backend wants
(`BlockLayout`, told from the tensor's shape). The CPU backend lays a block out as
`[kv_heads, block_size, 2 x head_dim]` and reads the first `block_size x head_dim` values of
each head as its keys and the rest as its values; the GPU backends keep keys and values apart,
FlashAttention as `[2, blocks, block_size, kv_heads, head_dim]`, FlashInfer and Triton as
`[blocks, 2, block_size, kv_heads, head_dim]`. The bytes of a head's keys or values are the
backend's own: a page is copied, never interpreted. The host pool keeps, for each slot, each
of this rank's KV heads and each part (K, V) contiguous across the layers, `[slots, heads, 2,
layers, block_size x head_dim]`, so one L3 object (a page's head and part) is one contiguous
run of host memory.

Loads run before the forward. On a CPU they are plain copies, done by then. On CUDA the host
pool is pinned and they go layer by layer on a stream of their own, each layer's copy marked
by an event; vLLM calls `wait_for_layer_load` before each layer's attention, and the compute
stream waits for that layer's event only (`wait_layer`), so layer 0 computes while later
layers still copy.

With peers on, the rank keeps a table of what its slots hold (tiers/peer_table.py) for
other engines to look up and read with one-sided reads: a slot's row is cleared before a
save or a fetch writes the slot and listed, with the sums of its bytes, once the write
landed; a reader that looked a row up before it was cleared finds the new bytes do not
match its sums (a miss, never wrong bytes).
"""
from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from kvtier.connector.l3_traffic import L3Traffic
from kvtier.connector.peer_traffic import HostPeerPool, PeerTraffic
from kvtier.connector.plan import PageLoad, PageSave, StepPlan, WorkerReport
from kvtier.vllm_engine.copy_stats import CopyStats
from kvtier.errors import ConfigError
from kvtier.tiers.peer_table import PeerTable

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


class BlockLayout(enum.Enum):
    """How an attention backend lays out one layer's KV tensor (the shape vLLM hands the
    connector, whatever the strides under it)."""

    CPU = "cpu"  # [num_blocks, kv_heads, block_size, 2 x head_dim]: K rows then V rows per head
    KV_FIRST = "kv_first"  # [2, num_blocks, block_size, kv_heads, head_dim]: FlashAttention's
    BLOCK_FIRST = "block_first"  # [num_blocks, 2, block_size, kv_heads, head_dim]: FlashInfer's

    def parts(self, layer: torch.Tensor) -> torch.Tensor:
        """`layer` as `[num_blocks, kv_heads, 2, block_size, head_dim]` (a view: writing it
        writes the layer)."""
        if self is BlockLayout.CPU:
            blocks, heads, block_size, two_dims = layer.shape
            return layer.view(blocks, heads, 2, block_size, two_dims // 2)
        if self is BlockLayout.KV_FIRST:
            return layer.permute(1, 3, 0, 2, 4)
        return layer.permute(0, 3, 1, 2, 4)

    def shape(self, expected: tuple[int, int, int, int]) -> tuple[int, ...]:
        """A layer's shape in this layout (`expected`: blocks, KV heads, block size, head
        dim)."""
        blocks, heads, block_size, head_dim = expected
        return {BlockLayout.CPU: (blocks, heads, block_size, 2 * head_dim),
                BlockLayout.KV_FIRST: (2, blocks, block_size, heads, head_dim),
                BlockLayout.BLOCK_FIRST: (blocks, 2, block_size, heads, head_dim)}[self]

    @classmethod
    def of(cls, layer: torch.Tensor, expected: tuple[int, int, int, int]) -> "BlockLayout":
        """The layout `layer` has (`expected`: blocks, this rank's KV heads, block size,
        head dim); ConfigError for a shape none of them has, or more than one: reading its
        blocks as a wrong layout would move wrong bytes."""
        found = [layout for layout in cls if tuple(layer.shape) == layout.shape(expected)]
        if found == [cls.CPU] and not layer.is_contiguous():
            found = []  # the CPU backend's bytes are read as one run per head
        if len(found) != 1:
            shapes = "; ".join(f"{list(layout.shape(expected))} ({layout.value})"
                               for layout in cls)
            raise ConfigError(f"KvtierConnector reads a layer's KV tensor as one of {shapes} "
                              f"(blocks, KV heads, block size, head dim: {list(expected)}); "
                              f"this engine's is {list(layer.shape)} on {layer.device}"
                              + (" and fits more than one" if found else "")
                              + ": its attention backend is not supported, run vLLM without "
                              f"the connector")
        return found[0]


@dataclass(frozen=True)
class PoolShape:
    """What one rank's host pool holds per slot."""

    num_layers: int
    kv_heads: int
    part_elems: int  # block_size x head_dim values per head and part
    dtype: torch.dtype

    @property
    def slot_bytes(self) -> int:
        return self.num_layers * self.kv_heads * 2 * self.part_elems * self.dtype.itemsize


def ordered_names(kv_caches: Mapping[str, torch.Tensor]) -> list[str]:
    """vLLM's layer names in layer order (by the index in each name)."""
    def index(name: str) -> int:
        found = _LAYER_INDEX.search(name)
        if found is None:
            raise ConfigError(f"cannot tell the layer index of vLLM KV cache {name!r}")
        return int(found.group(1))

    return sorted(kv_caches, key=index)


def ordered_layers(kv_caches: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
    """vLLM's per-layer KV tensors in layer order (by the index in each layer's name)."""
    return [kv_caches[name] for name in ordered_names(kv_caches)]


def pool_shape(layers: Sequence[torch.Tensor], layout: BlockLayout) -> PoolShape:
    """The host pool shape `layers` need; raises when the layers differ in shape or dtype."""
    first = layout.parts(layers[0])  # a view: nothing copied
    for i, layer in enumerate(layers):
        if layer.shape != layers[0].shape or layer.dtype != layers[0].dtype:
            raise ConfigError(f"vLLM KV cache layer {i} has shape {tuple(layer.shape)} "
                              f"{layer.dtype}, layer 0 {tuple(layers[0].shape)} "
                              f"{layers[0].dtype}: kvtier needs one KV cache group of "
                              f"identical layers")
    return PoolShape(len(layers), first.shape[1], first.shape[3] * first.shape[4], first.dtype)


class WorkerSide:
    """One TP rank: its host pool and the copies between it and vLLM's blocks."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor], num_slots: int,
                 layout: BlockLayout = BlockLayout.CPU, block_size: int = 0,
                 counts_tokens: bool = True,
                 expected: tuple[int, int, int, int] | None = None) -> None:
        """`block_size` and `counts_tokens` (rank 0 counts tokens, every rank its bytes) are
        for the stats only; `expected` (blocks, KV heads, block size, head dim), when given,
        tells the layout from the tensors' shape (`layout` is then ignored) and checks every
        layer has it."""
        if expected is not None:
            found = {BlockLayout.of(layer, expected) for layer in kv_caches.values()}
            if len(found) != 1:
                raise ConfigError(f"vLLM's KV cache layers come in several layouts "
                                  f"{sorted(x.value for x in found)}: kvtier needs one")
            (layout,) = found
        self.layout = layout
        layers = ordered_layers(kv_caches)
        self.layers = [layout.parts(t) for t in layers]
        self.layer_index = {name: i for i, name in enumerate(ordered_names(kv_caches))}
        self.shape = pool_shape(layers, layout)
        s = self.shape
        pin = torch.cuda.is_available() and self.layers[0].is_cuda
        # CUDA: loads go layer by layer on a stream of their own, each layer's copy followed
        # by an event the forward waits on before that layer's attention (`wait_layer`)
        self._stream = torch.cuda.Stream(self.layers[0].device) if pin else None
        self._landed: list[torch.cuda.Event | None] = [None] * len(self.layers)
        self._pinned: list[torch.Tensor] = []  # pinned rows the load stream still reads
        self.host = torch.empty((num_slots, s.kv_heads, 2, s.num_layers, s.part_elems),
                                dtype=s.dtype, pin_memory=pin)
        self.failed_blocks: set[int] = set()  # for vLLM to recompute
        self._failed_loads: frozenset[int] = frozenset()  # slots, for the step's report
        self._page_tokens = block_size if counts_tokens else 0
        self._stats = CopyStats()
        self.l3: L3Traffic | None = None  # attach_l3
        self.peers: PeerTraffic | None = None  # attach_peers
        self.table: PeerTable | None = None  # lend: the table of what the slots hold
        self.peer_pool = HostPeerPool(self.host)  # the host pool as peers read it
        self._fetching: dict[int, tuple[int, str]] = {}  # slot -> (generation, page key) of
        # the fetch reading into it

    def load(self, loads: Sequence[PageLoad]) -> frozenset[int]:
        """Copy L2 slots into vLLM blocks; returns the slots that could not be loaded (their
        blocks are in `failed_blocks` for vLLM to recompute)."""
        failed: set[int] = set()
        for load in loads:
            start = time.perf_counter()
            try:
                self._copy_in(load.slots, load.blocks)
            except (RuntimeError, IndexError):
                failed.update(load.slots)
                self.failed_blocks.update(load.blocks)
                self._count(CopyStats(failed_load_tokens=len(load.slots) * self._page_tokens))
                continue
            l2_pages = len(load.slots) - load.from_l3 - load.from_peer
            self._count(CopyStats(hit_tokens=l2_pages * self._page_tokens,
                                  l3_hit_tokens=load.from_l3 * self._page_tokens,
                                  peer_hit_tokens=load.from_peer * self._page_tokens,
                                  load_back_bytes=len(load.slots) * self.shape.slot_bytes,
                                  load_back_seconds=time.perf_counter() - start))
        return frozenset(failed)

    def save(self, saves: Sequence[PageSave]) -> tuple[frozenset[int], frozenset[int]]:
        """Copy full vLLM blocks into L2 slots: (saved slots, failed slots)."""
        saved: set[int] = set()
        failed: set[int] = set()
        for save in saves:
            start = time.perf_counter()
            self._unlist(save.slots)
            try:
                self._copy_out(save.blocks, save.slots)
            except (RuntimeError, IndexError):
                failed.update(save.slots)
                continue
            saved.update(save.slots)
            self._list(save.slots, save.keys)
            self._count(CopyStats(backup_tokens=len(save.slots) * self._page_tokens,
                                  backup_bytes=len(save.slots) * self.shape.slot_bytes,
                                  backup_seconds=time.perf_counter() - start))
        return frozenset(saved), frozenset(failed)

    def attach_l3(self, traffic: L3Traffic) -> None:
        """Write saved pages to L3 and read fetched ones, through `traffic` (its backend holds
        this pool registered)."""
        self.l3 = traffic

    def attach_peers(self, traffic: PeerTraffic) -> None:
        """Read the pages a plan fetches from peers through `traffic`."""
        self.peers = traffic

    def lend(self, table: PeerTable | None) -> None:
        """Keep `table` listing what the slots hold from now on (None: stop); a
        `PeerLender`'s publish hook, called before the first step."""
        self.table = table

    def begin_step(self, plan: StepPlan) -> None:
        """Before the forward: the plan's loads; its L3 writes and its reads from L3 and
        peers start in the background (after the loads: a slot a load reads may be refilled
        next)."""
        self._failed_loads |= self.load(plan.loads)
        for store in plan.stores:
            self._traffic.store(store.keys, store.slots)
        for fetch in plan.fetches:
            self._unlist(fetch.slots)
            self._fetching.update((slot, (fetch.gen, key))
                                  for slot, key in zip(fetch.slots, fetch.keys))
            if fetch.peer is None:
                self._traffic.fetch(fetch.keys, fetch.slots, fetch.gen)
            else:
                self._peer_traffic.fetch(fetch.peer, fetch.keys, fetch.first_page, fetch.slots,
                                         fetch.gen)

    def end_step(self, plan: StepPlan) -> WorkerReport:
        """After the forward: the plan's saves, and the step's report with the L3 work
        finished since the last one."""
        if self._stream is not None:  # every load landed (a layer nobody waited for too)
            self._stream.synchronize()
            self._landed = [None] * len(self.layers)
            self._pinned.clear()
        saved, failed = self.save(plan.saves)
        l3 = self.l3.take() if self.l3 is not None else None
        peers = self.peers.take() if self.peers is not None else None
        fetched = [*(l3.fetched if l3 else ()), *(peers.fetched if peers else ())]
        unread = [*(l3.failed_fetches if l3 else ()), *(peers.failed if peers else ())]
        held = [*(l3.held_fetches if l3 else ()), *(peers.held if peers else ())]
        released = [*(l3.released if l3 else ()), *(peers.released if peers else ())]
        listed = [(slot, self._fetching.pop(slot)[1]) for slot, gen in fetched
                  if self._fetching.get(slot, (None,))[0] == gen]  # this fetch's, not an
        # earlier one's: a slot is listed with the sums of the bytes it holds now
        self._list([slot for slot, _ in listed], [key for _, key in listed])
        for slot, gen in [*unread, *held]:
            if self._fetching.get(slot, (None,))[0] == gen:
                del self._fetching[slot]
        report = WorkerReport(saved=saved, failed_saves=failed, failed_loads=self._failed_loads,
                              stored=tuple(l3.stored) if l3 else (),
                              failed_stores=frozenset(l3.failed_stores) if l3 else frozenset(),
                              fetched=tuple(fetched), failed_fetches=tuple(unread),
                              held_fetches=tuple(held), released=tuple(released))
        self._failed_loads = frozenset()
        return report

    def _unlist(self, slots: Sequence[int]) -> None:
        """Before slots are written: peers no longer find what they held, and no sums a
        peer read left for them are kept."""
        if self.table is not None:
            self.table.clear(slots)
        self.peer_pool.sums.drop(slots)

    def _list(self, slots: Sequence[int], keys: Sequence[str]) -> None:
        """Slots now hold the pages keyed `keys` (whole, on this rank): peers find them, with
        the sums of their bytes ('' keys: a page whose key was not given, left unlisted)."""
        if self.table is None:
            return
        pairs = [(slot, key) for slot, key in zip(slots, keys) if key]
        if not pairs:
            return
        listed = [slot for slot, _ in pairs]
        heads = range(self.shape.kv_heads)
        sums = self.peer_pool.sums.sums(listed, self.shape.kv_heads,
                                        lambda missing: self.peer_pool.head_sums(missing, heads))
        self.table.publish(listed, [key for _, key in pairs], sums)

    @property
    def _traffic(self) -> L3Traffic:
        if self.l3 is None:
            raise RuntimeError("the plan moves pages to or from L3, but this worker has none "
                               "attached: the scheduler and the workers disagree on L3")
        return self.l3

    @property
    def _peer_traffic(self) -> PeerTraffic:
        if self.peers is None:
            raise RuntimeError("the plan reads pages from a peer, but this worker reads none: "
                               "the scheduler and the workers disagree on peers")
        return self.peers

    def close(self) -> None:
        if self.peers is not None:
            self.peers.close()
        if self.l3 is not None:
            self.l3.close()

    def take_stats(self) -> CopyStats:
        """The copies since the last call."""
        out, self._stats = self._stats, CopyStats()
        return out

    def _count(self, delta: CopyStats) -> None:
        self._stats = self._stats + delta

    def take_failed_blocks(self) -> set[int]:
        out, self.failed_blocks = self.failed_blocks, set()
        return out

    def wait_layer(self, name: str) -> None:
        """Before layer `name`'s attention: its loads of this step have landed (CUDA: the
        compute stream waits for that layer's copy; on CPU they landed before the forward)."""
        i = self.layer_index.get(name)
        event = None if i is None else self._landed[i]
        if event is not None:
            torch.cuda.current_stream(self.layers[0].device).wait_event(event)
            self._landed[i] = None

    def _copy_in(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        src = torch.tensor(slots, dtype=torch.long)
        device = self.layers[0].device
        if self._stream is None:  # CPU: every layer now, before the forward
            dst = torch.tensor(blocks, dtype=torch.long)
            rows = self.host.index_select(0, src)
            for i, layer in enumerate(self.layers):
                layer[dst] = rows[:, :, :, i].unflatten(3, layer.shape[3:])
            return
        # CUDA: gather the slots into pinned memory once, layer by layer contiguous, then one
        # copy per layer on the load stream, after what the compute stream queued so far
        # (blocks it may still use)
        gathered = self.host.index_select(0, src)  # [n, heads, 2, layers, elems]
        rows = torch.empty((gathered.shape[3], *gathered.shape[:3], gathered.shape[4]),
                           dtype=gathered.dtype, pin_memory=True)
        rows.copy_(gathered.permute(3, 0, 1, 2, 4))  # [layers, n, heads, 2, elems]
        self._stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(self._stream):
            dst = torch.tensor(blocks, dtype=torch.long).to(device, non_blocking=True)
            for i, layer in enumerate(self.layers):
                part = rows[i].to(device, non_blocking=True)
                layer[dst] = part.unflatten(3, layer.shape[3:])
                event = torch.cuda.Event()
                event.record(self._stream)
                self._landed[i] = event
        self._pinned.append(rows)  # kept until the step ends: the copies read it

    def _copy_out(self, blocks: Sequence[int], slots: Sequence[int]) -> None:
        src = torch.tensor(blocks, dtype=torch.long, device=self.layers[0].device)
        dst = torch.tensor(slots, dtype=torch.long)
        for i, layer in enumerate(self.layers):
            self.host[dst, :, :, i] = layer[src].flatten(3).to("cpu", non_blocking=False)
