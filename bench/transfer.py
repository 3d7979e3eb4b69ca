"""`kvtier bench transfer`: L1<->L2 copy bandwidth per host layout, against a plain copy.

Copies go through the CacheController (the path serving uses), best of `repeats` after a
warm-up, for fresh (contiguous) page ids and for ids from a scrambled allocator (fragmented).
`load_ratio` = load GB/s / plain contiguous copy GB/s of the same bytes, measured in this run.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvtier.cli.shared_flags import add_dtype_flag
from kvtier.errors import ConfigError, KvtierError
from kvtier.kv_spec import SMOLLM2_135M, KVSpec
from kvtier.policies import IoBackend, MemLayout
from kvtier.tiers.allocator import PageAllocator
from kvtier.tiers.controller import CacheController
from kvtier.tiers.device_pool import DevicePool, default_device
from kvtier.tiers.host_pool import HostPool

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DEVICE_POOL_FACTOR = 1.5  # L1 holds more pages than one transfer moves, so ids look real
HOST_RATIO = 2.0  # the reference's default --hicache-ratio


@dataclass(frozen=True)
class TransferBenchParams:
    pages: int = 256
    page_size: int = 64
    dtype: str = "bf16"
    repeats: int = 5
    io_backends: tuple[IoBackend, ...] = (IoBackend.KERNEL, IoBackend.DIRECT)  # first: headline
    seed: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--pages", type=int, default=TransferBenchParams.pages, help="pages per transfer")
    parser.add_argument("--page-size", type=int, default=TransferBenchParams.page_size, help="tokens per page")
    # the copied pages' dtype: no model here, so no auto (which resolves a model's), and fp16
    add_dtype_flag(parser, TransferBenchParams.dtype, choices=sorted(DTYPES),
                   subject="KV page dtype")
    parser.add_argument("--repeats", type=int, default=TransferBenchParams.repeats, help="best of R timed runs")
    parser.add_argument("--io-backend", action="append", choices=[b.value for b in IoBackend],
                        help="measure these backends (repeatable; default: kernel and direct)")


def params_from(ns: argparse.Namespace) -> TransferBenchParams:
    backends = tuple(IoBackend.parse(b, "--io-backend") for b in ns.io_backend or ()) or TransferBenchParams.io_backends
    return TransferBenchParams(ns.pages, ns.page_size, ns.dtype, ns.repeats, backends)


def run(argv_or_params: Sequence[str] | TransferBenchParams | None = None) -> dict:
    """Run the benchmark; returns the JSON-ready result."""
    if isinstance(argv_or_params, TransferBenchParams):
        params = argv_or_params
    else:
        parser = argparse.ArgumentParser(prog="kvtier bench transfer")
        add_arguments(parser)
        params = params_from(parser.parse_args(list(argv_or_params or [])))
    if params.pages < 1 or params.repeats < 1 or params.page_size < 1:
        raise ConfigError("--pages, --page-size and --repeats must be at least 1")
    if params.dtype not in DTYPES:
        raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {params.dtype!r}")
    started = time.perf_counter()
    spec = KVSpec(page_size=params.page_size, dtype=DTYPES[params.dtype], **SMOLLM2_135M)
    device = default_device()
    nbytes = params.pages * spec.page_bytes
    plain = _Plain(nbytes, spec.dtype, device, params.repeats)
    result: dict = {
        "device": str(device), "dtype": params.dtype, "pages": params.pages, "page_size": params.page_size,
        "bytes": nbytes, "page_bytes": spec.page_bytes, "repeats": params.repeats,
        "torch_threads": torch.get_num_threads(), "io_backend": params.io_backends[0].value,
    }
    backends: dict = {b.value: {"layouts": {}, "layouts_fragmented": {}} for b in params.io_backends}
    with DevicePool(spec, int(params.pages * DEVICE_POOL_FACTOR)) as dev:
        for layout in MemLayout:
            with HostPool.for_device(dev, layout, ratio=HOST_RATIO) as host:
                result["device_pool_pages"], result["host_pool_pages"] = dev.num_pages, host.num_pages
                rng = random.Random(params.seed)  # the same ids for every layout
                for fragmented in (False, True):
                    dev_pages = _ids(dev.num_pages, params.pages, fragmented, rng)
                    host_pages = _ids(host.num_pages, params.pages, fragmented, rng)
                    for backend in params.io_backends:
                        entry = _measure(dev, host, backend, dev_pages, host_pages, params.repeats, nbytes)
                        plain.measure()  # interleaved, so the ratio sees the same machine state
                        key = "layouts_fragmented" if fragmented else "layouts"
                        backends[backend.value][key][layout.value] = entry
    result["plain_copy_gbps"] = round(plain.best_gbps, 3)
    for per_backend in backends.values():
        for entries in per_backend.values():
            for entry in entries.values():
                entry["load_ratio"] = round(entry["load_gbps"] / plain.best_gbps, 3)
    headline = backends[params.io_backends[0].value]
    result["layouts"], result["layouts_fragmented"] = headline["layouts"], headline["layouts_fragmented"]
    result["backends"] = backends
    result["elapsed_s"] = round(time.perf_counter() - started, 2)
    return result


def _ids(pool_pages: int, n: int, fragmented: bool, rng: random.Random) -> list[int]:
    """What an allocator hands out: ascending when fresh; with `fragmented`, from a free list
    shuffled at random (a worst case: real eviction frees whole requests' runs of pages)."""
    allocator = PageAllocator(pool_pages)
    if fragmented:
        every = allocator.alloc(pool_pages)
        rng.shuffle(every)
        allocator.free(every)
    pages = allocator.alloc(n)
    assert pages is not None
    return pages


def _measure(dev: DevicePool, host: HostPool, backend: IoBackend, dev_pages: list[int], host_pages: list[int],
             repeats: int, nbytes: int) -> dict:
    with CacheController(dev, host, backend) as ctl:
        def write() -> None:
            ctl.write(dev_pages, host_pages)
            ctl.wait_writes()
            ctl.poll_writes()

        def load() -> None:
            ctl.load(host_pages, dev_pages).wait()

        write_s, load_s = _best(write, repeats, dev.device), _best(load, repeats, dev.device)
        handle = ctl.load(host_pages, dev_pages)
        handle.wait()
    plan = handle.plan
    return {
        "write_gbps": round(nbytes / write_s / 1e9, 3),
        "load_gbps": round(nbytes / load_s / 1e9, 3),
        "copy_calls_per_layer_group": plan.calls(backend),
        "load_layer_groups": len(handle.groups),
    }


def _best(step: Callable[[], None], repeats: int, device: torch.device) -> float:
    step()  # warm-up: first touch of host pages, allocator caches
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Plain:
    """A plain contiguous copy of the same bytes: host (pinned on CUDA) to device."""

    def __init__(self, nbytes: int, dtype: torch.dtype, device: torch.device, repeats: int) -> None:
        numel = nbytes // torch.empty((), dtype=dtype).element_size()
        self.src = torch.ones(numel, dtype=dtype, pin_memory=device.type == "cuda")
        self.dst = torch.zeros(numel, dtype=dtype, device=device)
        self.nbytes, self.repeats, self.device = nbytes, repeats, device
        self.best_gbps = 0.0
        self.measure()

    def measure(self) -> None:
        seconds = _best(lambda: self.dst.copy_(self.src), self.repeats, self.device)
        self.best_gbps = max(self.best_gbps, self.nbytes / seconds / 1e9)


def main(ns: argparse.Namespace) -> int:
    try:
        result = run(params_from(ns))
    except KvtierError as error:
        print(f"kvtier bench transfer: {error}", file=sys.stderr)
        return 1
    if ns.json:
        print(json.dumps(result))
        return 0
    print(f"plain copy {result['plain_copy_gbps']:.2f} GB/s on {result['device']} ({result['bytes'] / 2**20:.0f} MiB)")
    for backend, per in result["backends"].items():
        for key, entries in per.items():
            for layout, e in entries.items():
                print(f"{backend:6} {key:18} {layout:17} write {e['write_gbps']:6.2f}  load {e['load_gbps']:6.2f} GB/s"
                      f"  ratio {e['load_ratio']:.2f}")
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="kvtier bench transfer")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
