"""`kvtier bench storage --backend nixl`: the nixl backend against raw NIXL, in one run.

All sides move the same bytes between the same host pool pages (page_head layout, as
under L3) and files of the same size, one per object (KV head and part), with the payload
at the same offset, through agents with the same POSIX plugin settings and the host pool
registered once beforehand:
- kvtier: `set_from` / `get_into` of all pages in one call (names, temp file + link,
  header, capacity index; writes one NIXL request per MAX_OBJECTS_PER_TRANSFER objects,
  reads one per READ_CHUNK_BYTES of pages, pipelined: backends/nixl_backend.py), twice,
  on backends and roots of their own: with `verify_checksums` on (the default, the
  top-level figures: xxh3 over every page part on reads) and off (`unverified_*`).
- raw: open (create) the files, register them, one initialize_xfer + transfer + busy wait,
  release, deregister, close: the least any NIXL POSIX user does for the same job.
Writes start from a clean page cache (`os.sync` before each, untimed) and go to fresh
files; reads are of the files a kvtier backend just wrote (page-cache hot: the common L3 hit
on one machine; raw reads the verified backend's). The sides take turns going first; best
of `repeats` (file creation alone varies 5x between runs on a shared virtual disk, so one
run says little). Every read lands on zeroed pages and is checked against the written ones.
`objects` (storage_measure): a batch is every page in one call; its calls are NIXL requests.
`object_bytes`: one object's payload (kvtier's files add the header: `bytes_per_object`).
`exists_1000_ms`: one `exists` of 1,000 stored pages (2,000 stats), tiny pages on the same root.
`verify_ms`: xxh3 over every landed page part once, timed alone: what read verification
would cost serially (the backend hashes each chunk while NIXL moves the next).
"""
from __future__ import annotations

import logging
import os
import shutil
from typing import Callable

import numpy as np
import torch
import xxhash

from kvtier.backends.base import KV_POOL, StorageTarget
from kvtier.backends.nixl_agent import PLUGIN, POSIX_PARAMS, nixl_api
from kvtier.backends.nixl_backend import NixlBackend
from kvtier.backends.nixl_object import HEADER_BYTES, object_bytes
from kvtier.backends.registry import create_backend
from kvtier.bench.storage_measure import SIDES, VERIFY, BatchShape, report, rotated, timed
from kvtier.errors import ConfigError, TransferError
from kvtier.keys import KeyNamespace, page_hashes
from kvtier.kv_spec import SMOLLM2_135M, HeadRange, KVSpec
from kvtier.policies import MemLayout
from kvtier.storage_options import NixlOptions
from kvtier.tiers.host_pool import HostPool

log = logging.getLogger(__name__)

SPEC = KVSpec(**SMOLLM2_135M, page_size=64, dtype=torch.bfloat16)  # parts of 737,280 B
_TINY = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4)
EXISTS_KEYS = 1000


def measure(pages: int, root_dir: str, repeats: int = 5) -> dict:
    """Write/read bandwidth of the nixl backend, with and without verification, and of raw
    NIXL over the same descriptors, with per-object figures.

    Everything it writes lives under `root_dir/nixl-bench-<pid>/` and is removed at the end.
    """
    if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1 or repeats < 1:
        raise ConfigError("bench storage: pages and repeats must be positive, got "
                          f"{pages}, {repeats}")
    work = os.path.join(root_dir, f"nixl-bench-{os.getpid()}")
    stores = {side: os.path.join(work, side) for side in VERIFY}
    raw_dir = os.path.join(work, "raw")
    pool = HostPool(SPEC, 2 * pages, MemLayout.PAGE_HEAD)  # [0, n) written, [n, 2n) read into
    pool.kv.view(-1).view(torch.uint8).random_(0, 256)
    src, dst = list(range(pages)), list(range(pages, 2 * pages))
    ns = KeyNamespace("bench-nixl", "", "smollm2")
    heads = HeadRange.all_of(SPEC.num_kv_heads)
    backends: dict[str, NixlBackend] = {}
    raw = _RawNixl()
    best = {side + phase: float("inf") for side in SIDES for phase in ("_w", "_r")}
    try:
        for side, verify in VERIFY.items():
            options = NixlOptions(root_dir=stores[side], verify_checksums=verify)
            backends[side] = NixlBackend(options, StorageTarget(ns, heads))
            backends[side].register_pool(KV_POOL, pool)
        counts = [_count_requests(b) for b in backends.values()]

        def requests() -> int:  # NIXL requests made so far, by every side
            return raw.requests + sum(count[0] for count in counts)
        raw.register(pool)
        objects = [(h, part) for h in range(heads.count) for part in (0, 1)]
        views = [pool.page_head_view(p, h, part) for p in src for h, part in objects]
        landing = [pool.page_head_view(p, h, part) for p in dst for h, part in objects]
        nbytes = sum(v.numel() for v in views)
        calls: dict[str, int] = {}
        for rep in range(repeats):
            keys = page_hashes(np.arange(rep * pages * 4, (rep + 1) * pages * 4), 4)
            names = [backends["kv"].target.object_name(KV_POOL, k, h, part)
                     for k in keys for h, part in objects]
            files = [os.path.join(stores["kv"], n) for n in names]
            raw_files = [os.path.join(raw_dir, str(rep), f"{i}") for i in range(len(files))]
            os.makedirs(os.path.join(raw_dir, str(rep)), exist_ok=True)
            ops = {"raw_w": lambda: raw.run("WRITE", views, raw_files),
                   "raw_r": lambda: raw.run("READ", landing, files)}
            for side, b in backends.items():
                ops.update(_ops(side, b, keys, src, dst))
            for phase in ("_w", "_r"):
                for side in rotated(list(SIDES), rep):
                    op = side + phase
                    if phase == "_w":
                        os.sync()  # each write starts with no dirty pages of the previous one
                    else:
                        for v in landing:  # a read that moved nothing must not pass the check
                            v.zero_()
                    before = requests()
                    best[op] = min(best[op], timed(ops[op]))
                    calls[op] = requests() - before
                    if phase == "_r":
                        _check([all(torch.equal(pool.page_part_view(s, part),
                                                pool.page_part_view(d, part)) for part in (0, 1))
                                for s, d in zip(src, dst)], f"{op} round trip (bytes differ)")
            for b in backends.values():
                b.delete(keys)
            shutil.rmtree(os.path.join(raw_dir, str(rep)))
        verify_s = min(timed(lambda: [xxhash.xxh3_64_intdigest(v.numpy()) for v in landing])
                       for _ in range(3))
        exists_ms = _exists_1000_ms(stores["kv"])
    finally:
        raw.close()
        for b in backends.values():
            b.close()
        pool.close()
        shutil.rmtree(work, ignore_errors=True)
    payload = SPEC.page_part_bytes // SPEC.num_kv_heads
    shapes = {side: BatchShape(len(views), payload if side == "raw" else object_bytes(payload),
                               calls[f"{side}_w"], calls[f"{side}_r"]) for side in SIDES}
    return {
        **report(best, nbytes, pages, shapes),
        "exists_1000_ms": round(exists_ms, 3),
        "verify_ms": round(verify_s * 1e3, 3),
        "page_bytes": SPEC.page_bytes,  # K and V of one page (one object per head and part)
        "object_bytes": payload,
        "layout": MemLayout.PAGE_HEAD.value,
        "pages": pages,
    }


def _ops(side: str, backend: NixlBackend, keys: list[str], src: list[int],
         dst: list[int]) -> dict[str, Callable[[], None]]:
    return {f"{side}_w": lambda: _check(backend.set_from(KV_POOL, keys, src).ok, f"{side} write"),
            f"{side}_r": lambda: _check(backend.get_into(KV_POOL, keys, dst).ok, f"{side} read")}


def _count_requests(backend: NixlBackend) -> list[int]:
    """Counts the NIXL requests `backend` makes from now on, in the one-element list returned."""
    count = [0]
    transfer = backend.agent.transfer

    def counted(*args, **kw) -> bool:
        count[0] += 1
        return transfer(*args, **kw)
    backend.agent.transfer = counted
    return count


def _check(ok: list[bool], what: str) -> None:
    if not all(ok):
        raise TransferError(f"bench storage: the nixl backend {what} failed for {ok.count(False)} "
                            "pages; see the log above, and check the disk under root_dir")


def _exists_1000_ms(store: str) -> float:
    """One `exists` over 1,000 present pages (every part stat'ed), best of 3."""
    pool = HostPool(_TINY, EXISTS_KEYS, MemLayout.PAGE_HEAD)
    backend = create_backend("nixl", StorageTarget(KeyNamespace("bench-exists")),
                             {"root_dir": store})
    try:
        backend.register_pool(KV_POOL, pool)
        keys = page_hashes(np.arange(EXISTS_KEYS * 4), 4)
        _check(backend.set_from(KV_POOL, keys, list(range(EXISTS_KEYS))).ok, "write")
        best = min(timed(lambda: backend.exists(keys)) for _ in range(3))
        _check([backend.exists(keys).usable_pages == EXISTS_KEYS], "exists")
        backend.delete(keys)
        return best * 1e3
    finally:
        backend.close()
        pool.close()


class _RawNixl:
    """The baseline: NIXL's Python API used directly, nothing around it."""

    def __init__(self) -> None:
        api = nixl_api()  # NIXL's own API; only its log lines go to stderr
        self.name = f"kvtier-bench-raw-{os.getpid()}"
        self.agent = api.nixl_agent(self.name,
                                    api.nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend(PLUGIN, dict(POSIX_PARAMS))
        self.dram = None
        self.requests = 0  # NIXL requests made (one per run)

    def register(self, pool: HostPool) -> None:
        self.dram = self.agent.register_memory([(pool.data_ptr(), pool.nbytes, 0, "")], "DRAM",
                                               backends=[PLUGIN])

    def run(self, op: str, views: list[torch.Tensor], paths: list[str]) -> None:
        flags = os.O_RDONLY if op == "READ" else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fds = [os.open(p, flags, 0o600) for p in paths]
        a = self.agent
        try:
            reg = a.register_memory([(0, object_bytes(v.numel()), fd, "")
                                     for v, fd in zip(views, fds)], "FILE", backends=[PLUGIN])
            local = a.get_xfer_descs([(v.data_ptr(), v.numel(), 0) for v in views], "DRAM")
            remote = a.get_xfer_descs([(HEADER_BYTES, v.numel(), fd)
                                       for v, fd in zip(views, fds)], "FILE")
            handle = a.initialize_xfer(op, local, remote, self.name, backends=[PLUGIN])
            self.requests += 1
            state = a.transfer(handle)
            while state == "PROC":
                state = a.check_xfer_state(handle)
            a.release_xfer_handle(handle)
            a.deregister_memory(reg, backends=[PLUGIN])
            if state != "DONE":
                raise TransferError(f"bench storage: raw NIXL {op} failed ({state})")
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        if self.dram is not None:
            self.agent.deregister_memory(self.dram, backends=[PLUGIN])
            self.dram = None
