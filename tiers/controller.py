"""The cache controller: asynchronous L1->L2 writes and layer-by-layer L2->L1 loads.

One worker thread issues every copy (torch copy ops release the GIL, so the scheduler keeps
running). On CUDA it issues on a write stream and a higher-priority load stream and marks
progress with CUDA events: loads overlap writes, and the forward pass chains on events.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterator, NamedTuple, Sequence

import torch

from kvtier.errors import ClosedError, TransferError
from kvtier.policies import IoBackend
from kvtier.tiers.device_pool import DevicePool
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.page_copy import CopyPlan, copy_pages

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiter checks that the worker is still alive
Event = torch.cuda.Event


class TransferStats(NamedTuple):
    """Counters of landed copies (bytes of K and V over all layers)."""

    write_ops: int = 0
    write_batches: int = 0  # merged copies that served the write ops
    write_bytes: int = 0
    write_s: float = 0.0
    load_ops: int = 0
    load_bytes: int = 0
    load_s: float = 0.0


class _Fence:
    """One copy step. The worker signals it once issued (on CPU that means landed); on CUDA an
    event on the copy stream then says when it landed."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self.start: Event | None = None
        self.event: Event | None = None
        self.wall_s = 0.0
        self.error: BaseException | None = None
        self.reported = False  # the error reached a caller once

    def signal(self, wall_s: float, start: Event | None, event: Event | None) -> None:
        self.wall_s, self.start, self.event = wall_s, start, event
        self._issued.set()

    def fail(self, error: BaseException) -> None:
        if not self._issued.is_set():
            self.error = error
            self._issued.set()

    def settled(self) -> bool:
        """Landed or failed: nothing more will happen to it."""
        return self._issued.is_set() and (self.error is not None or self.event is None or self.event.query())

    def wait(self, alive: Callable[[], bool], sync: bool) -> None:
        while not self._issued.wait(_POLL_S):
            if not alive():
                raise TransferError("the transfer worker died; close the controller and create a new one")
        if self.event is not None and sync:
            self.event.synchronize()

    def seconds(self) -> float:
        if self.start is not None and self.event is not None:
            return self.start.elapsed_time(self.event) / 1000.0
        return self.wall_s


@dataclass(eq=False)
class _WriteOp:
    op_id: int
    plan: CopyPlan
    ready: Event | None  # CUDA: the compute stream's work up to the submission
    fence: _Fence = field(default_factory=_Fence)


class LoadHandle:
    """One L2->L1 load; layers land in order, layer 0 first."""

    def __init__(self, op_id: int, plan: CopyPlan, num_layers: int, group: int, ready: Event | None,
                 alive: Callable[[], bool]) -> None:
        self.op_id, self.plan, self.num_layers, self.ready, self._alive = op_id, plan, num_layers, ready, alive
        # Layers copied per call (see CopyPlan.layers_per_call); the layers of a group share a fence.
        self.groups = [(a, min(a + group, num_layers), _Fence()) for a in range(0, num_layers, group)]
        self.fences = [fence for a, b, fence in self.groups for _ in range(a, b)]
        self.error: BaseException | None = None
        self.reported = False

    def wait_layer(self, layer: int) -> None:
        """Block until `layer` landed (on CUDA: make the current stream wait for it)."""
        if not 0 <= layer < self.num_layers:
            raise TransferError(f"layer {layer} is outside 0..{self.num_layers - 1}")
        fence = self.fences[layer]
        fence.wait(self._alive, sync=False)
        if self.error is not None:
            self.reported = True
            raise TransferError(
                f"load {self.op_id} (L2->L1) failed: {type(self.error).__name__}: {self.error}; "
                "recompute these tokens: the device pages hold partial data"
            ) from self.error
        if fence.event is not None:
            torch.cuda.current_stream().wait_event(fence.event)

    def wait(self) -> None:
        """Block until every layer landed."""
        self.wait_layer(self.num_layers - 1)

    def done(self) -> bool:
        return self.error is None and all(fence.settled() for _, _, fence in self.groups)


class CacheController:
    """Moves pages between one rank's L1 and L2 pools; loads go before writes.

    Call it from one thread (the rank's scheduler); the worker thread is internal.
    """

    def __init__(self, device_pool: DevicePool, host_pool: HostPool, io_backend: IoBackend = IoBackend.KERNEL) -> None:
        if device_pool.spec != host_pool.spec:
            raise TransferError("device and host pools have different KVSpecs; build both from one spec")
        self.device_pool, self.host_pool = device_pool, host_pool
        self.io_backend = IoBackend.parse(io_backend, "--hicache-io-backend")
        self._cuda = device_pool.device.type == "cuda"
        dev = device_pool.device
        self._streams = (torch.cuda.Stream(dev), torch.cuda.Stream(dev, priority=-1)) if self._cuda else None
        self._ids = itertools.count()
        self._cond = threading.Condition()
        self._write_queue: deque[_WriteOp] = deque()  # not yet taken by the worker
        self._load_queue: deque[LoadHandle] = deque()
        self._unacked: deque[_WriteOp] = deque()  # submission order, until poll_writes acks them
        self._loads: list[LoadHandle] = []  # what the controller-level wait_layer covers
        self._unaccounted: list[tuple[bool, _Fence, int, int]] = []  # (is_write, fence, ops, bytes)
        self._stats = TransferStats()
        self._stopping = self._closed = False
        self._thread = threading.Thread(target=self._work, name="kvtier-cache-controller", daemon=True)
        self._thread.start()

    def write(self, device_pages: Sequence[int], host_pages: Sequence[int]) -> int:
        """Queue a copy of L1 pages into L2 pages (all layers); returns the op id to ack."""
        self._check_open()
        plan = CopyPlan.build(device_pages, host_pages, self.device_pool.num_pages, self.host_pool.num_pages)
        op = _WriteOp(next(self._ids), plan, self._ready_event())
        with self._cond:
            self._write_queue.append(op)
            self._unacked.append(op)
            self._cond.notify()
        return op.op_id

    def poll_writes(self) -> list[int]:
        """Ids of writes that landed since the last poll, in submission order.

        A failed write raises TransferError (its `op_ids` names the writes whose host pages hold
        no valid copy), once the acks submitted before it were handed out.
        """
        self._check_open()
        acked: list[int] = []
        while self._unacked and self._unacked[0].fence.settled():
            fence = self._unacked[0].fence
            if fence.error is None:
                acked.append(self._unacked.popleft().op_id)
                continue
            if acked:
                break  # hand out the acks first; the failure surfaces on the next call
            failed = [self._unacked.popleft()]
            while self._unacked and self._unacked[0].fence.error is fence.error:  # same batch
                failed.append(self._unacked.popleft())
            if not fence.reported:
                raise self._write_error(failed)
        return acked

    def wait_writes(self) -> None:
        """Block until every queued write landed; raise TransferError for any that failed."""
        self._check_open()
        ops = list(self._unacked)
        for op in ops:
            op.fence.wait(self._thread.is_alive, sync=True)
        failed = [op for op in ops if op.fence.error is not None and not op.fence.reported]
        if failed:
            raise self._write_error(failed)

    def _write_error(self, failed: list[_WriteOp]) -> TransferError:
        for op in failed:
            op.fence.reported = True
        error = failed[0].fence.error
        err = TransferError(
            f"writes {[op.op_id for op in failed]} (L1->L2) failed: {type(error).__name__}: {error}; "
            "their host pages hold no valid copy: free them and keep those pages in L1 only"
        )
        err.op_ids = tuple(op.op_id for op in failed)  # type: ignore[attr-defined]
        err.__cause__ = error
        return err

    def load(self, host_pages: Sequence[int], device_pages: Sequence[int]) -> LoadHandle:
        """Queue a copy of L2 pages into L1 pages, layer by layer; returns a handle to wait on."""
        self._check_open()
        plan = CopyPlan.build(host_pages, device_pages, self.host_pool.num_pages, self.device_pool.num_pages)
        spec = self.device_pool.spec
        group = plan.layers_per_call(self.io_backend, spec.page_layer_bytes, spec.num_layers)
        handle = LoadHandle(next(self._ids), plan, spec.num_layers, group, self._ready_event(), self._thread.is_alive)
        with self._cond:
            self._load_queue.append(handle)
            self._loads = [h for h in self._loads if not (h.done() or h.reported)]
            self._loads.append(handle)
            self._cond.notify()
        return handle

    def wait_layer(self, layer: int) -> tuple[LoadHandle, ...]:
        """Wait for `layer` of every load submitted so far (call right before attention on
        it). Returns the loads found failed, each once (their L1 pages hold partial data; their
        own handles still raise): the caller keeps its forward going and makes sure nobody
        uses those pages, instead of leaving a forward its TP peers are inside."""
        self._check_open()
        failed = []
        for handle in list(self._loads):
            if handle.reported:
                continue  # its failure already reached a caller through its handle
            try:
                handle.wait_layer(layer)
            except TransferError:
                if handle.error is None:  # the worker died: nothing will land any more
                    raise
                failed.append(handle)
        self._loads = [h for h in self._loads if not (h.done() or h.reported)]
        return tuple(failed)

    def stats(self) -> TransferStats:
        """Counters of the copies that landed so far (works after close too)."""
        with self._cond:
            pending, self._unaccounted = self._unaccounted, []
        s = self._stats._asdict()
        for entry in pending:
            is_write, fence, ops, nbytes = entry
            if not fence.settled():
                self._unaccounted.append(entry)
            elif fence.error is None:
                kind = "write" if is_write else "load"
                s[f"{kind}_ops"] += ops
                s[f"{kind}_bytes"] += nbytes
                s[f"{kind}_s"] += fence.seconds()
                s["write_batches"] += is_write
        self._stats = TransferStats(**s)
        return self._stats

    def close(self) -> None:
        """Finish the queued copies, stop the worker and join it."""
        if self._closed:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join()
        for stream in self._streams or ():
            stream.synchronize()
        self._closed = True
        lost = [op.op_id for op in self._unacked if op.fence.error is not None and not op.fence.reported]
        if lost:
            log.error("controller closed with failed writes never polled: %s", lost)

    def __enter__(self) -> "CacheController":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed or self._stopping:
            raise ClosedError("the cache controller is closed; create a new CacheController")

    def _ready_event(self) -> Event | None:
        """On CUDA, what a copy must wait for: the compute stream's work so far."""
        if not self._cuda:
            return None
        event = Event()
        event.record(torch.cuda.current_stream(self.device_pool.device))
        return event

    def _work(self) -> None:
        while True:
            with self._cond:
                while not (self._load_queue or self._write_queue or self._stopping):
                    self._cond.wait()
                if self._load_queue:
                    job: LoadHandle | list[_WriteOp] = self._load_queue.popleft()
                elif self._write_queue:
                    job = self._take_write_batch()
                else:
                    return  # stopping, and the queues are drained
            if isinstance(job, LoadHandle):
                self._run_load(job)
            else:
                self._run_writes(job)

    def _take_write_batch(self) -> list[_WriteOp]:
        """Every waiting write, merged while their host pages stay disjoint (so order holds)."""
        batch: list[_WriteOp] = []
        seen: set[int] = set()
        while self._write_queue:
            pages = set(self._write_queue[0].plan.dst_pages)
            if batch and not seen.isdisjoint(pages):
                break
            seen |= pages
            batch.append(self._write_queue.popleft())
        return batch

    def _run_writes(self, batch: list[_WriteOp]) -> None:
        try:
            plan = batch[0].plan if len(batch) == 1 else CopyPlan.build(
                [p for op in batch for p in op.plan.src_pages], [p for op in batch for p in op.plan.dst_pages],
                self.device_pool.num_pages, self.host_pool.num_pages,
            )
            src, dst = self.device_pool.layer_page_view(), self.host_pool.layer_page_view()
            with self._on_stream(0, [op.ready for op in batch]) as start:
                t0 = time.perf_counter()
                copy_pages(src, dst, plan, self.io_backend, non_blocking=self._cuda)
                event = self._record()
            for op in batch:
                op.fence.signal(time.perf_counter() - t0, start, event)
            self._account(True, batch[0].fence, len(batch), plan.num_pages)
        except Exception as error:  # surfaced by poll_writes / wait_writes, never dropped
            log.debug("write batch failed", exc_info=True)
            for op in batch:
                op.fence.fail(error)

    def _run_load(self, handle: LoadHandle) -> None:
        try:
            src, dst = self.host_pool.layer_page_view(), self.device_pool.layer_page_view()
            with self._on_stream(1, [handle.ready]) as start:
                t0 = time.perf_counter()
                for first, end, fence in handle.groups:
                    copy_pages(src, dst, handle.plan, self.io_backend, slice(first, end), non_blocking=self._cuda)
                    fence.signal(time.perf_counter() - t0, start, self._record())
            self._account(False, handle.groups[-1][2], 1, handle.plan.num_pages)
        except Exception as error:  # surfaced by the handle's waits, never dropped
            log.debug("load %d failed", handle.op_id, exc_info=True)
            handle.error = error
            for _, _, fence in handle.groups:
                fence.fail(error)

    @contextlib.contextmanager
    def _on_stream(self, which: int, ready: list[Event | None]) -> Iterator[Event | None]:
        """Run on the write (0) or load (1) stream after `ready`; yields a start event."""
        if self._streams is None:
            yield None
            return
        stream = self._streams[which]
        with torch.cuda.stream(stream):
            for event in ready:
                if event is not None:
                    stream.wait_event(event)
            yield self._record()

    def _record(self) -> Event | None:
        if not self._cuda:
            return None
        event = Event(enable_timing=True)
        event.record()
        return event

    def _account(self, is_write: bool, fence: _Fence, ops: int, pages: int) -> None:
        with self._cond:
            self._unaccounted.append((is_write, fence, ops, pages * self.device_pool.spec.page_bytes))
