"""`kvtier bench storage --backend nixl`: the nixl backend against raw NIXL, in one run.

Both sides move the same bytes between the same host pool pages (page_head layout, as
under L3) and files of the same size, one per object (KV head and part), with the payload at the same offset, through an agent with the same POSIX plugin
settings and the host pool registered once beforehand:
- kvtier: `set_from` / `get_into` of all pages in one call (names, temp file + link,
  header, xxh3 over every page, capacity index, one NIXL request).
- raw: open (create) the files, register them, one initialize_xfer + transfer + busy wait,
  release, deregister, close: the least any NIXL POSIX user does for the same job.
Writes start from a clean page cache (`os.sync` before each, untimed) and go to fresh
files; reads are of the files the backend just wrote (page-cache hot: the common L3 hit on
one machine). kvtier and raw alternate going first; best of `repeats` (file creation alone
varies 5x between runs on a shared virtual disk, so one run says little).
`exists_1000_ms`: one `exists` of 1,000 stored pages (2,000 stats), tiny pages on the same root.
`verify_ms`: xxh3 over every landed page part once, timed alone: what read verification
costs (it runs after NIXL's single request completes, so it adds to the read time).
"""
from __future__ import annotations

import logging
import os
import shutil

import numpy as np
import torch
import xxhash

from kvtier.backends.base import KV_POOL, StorageTarget
from kvtier.backends.nixl_agent import PLUGIN, POSIX_PARAMS
from kvtier.backends.nixl_object import HEADER_BYTES, object_bytes
from kvtier.backends.registry import create_backend
from kvtier.bench.storage_measure import bandwidth_report, timed
from kvtier.errors import ConfigError, TransferError
from kvtier.keys import KeyNamespace, page_hashes
from kvtier.kv_spec import SMOLLM2_135M, HeadRange, KVSpec
from kvtier.policies import MemLayout
from kvtier.tiers.host_pool import HostPool

log = logging.getLogger(__name__)

SPEC = KVSpec(**SMOLLM2_135M, page_size=64, dtype=torch.bfloat16)  # parts of 737,280 B
_TINY = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4)
EXISTS_KEYS = 1000


def measure(pages: int, root_dir: str, repeats: int = 5) -> dict:
    """Write/read bandwidth of the nixl backend and of raw NIXL over the same descriptors.

    Everything it writes lives under `root_dir/nixl-bench-<pid>/` and is removed at the end.
    """
    if isinstance(pages, bool) or not isinstance(pages, int) or pages < 1 or repeats < 1:
        raise ConfigError(f"bench storage: pages and repeats must be positive, got {pages}, {repeats}")
    work = os.path.join(root_dir, f"nixl-bench-{os.getpid()}")
    store, raw_dir = os.path.join(work, "kvtier"), os.path.join(work, "raw")
    pool = HostPool(SPEC, 2 * pages, MemLayout.PAGE_HEAD)  # [0, n) written, [n, 2n) read into
    pool.kv.view(-1).view(torch.uint8).random_(0, 256)
    src, dst = list(range(pages)), list(range(pages, 2 * pages))
    ns = KeyNamespace("bench-nixl", "", "smollm2")
    heads = HeadRange.all_of(SPEC.num_kv_heads)
    backend = create_backend("nixl", StorageTarget(ns, heads), {"root_dir": store})
    raw = _RawNixl()
    best = {"write": 0.0, "read": 0.0, "raw_write": 0.0, "raw_read": 0.0}
    try:
        backend.register_pool(KV_POOL, pool)
        raw.register(pool)
        objects = [(h, part) for h in range(heads.count) for part in (0, 1)]
        views = [pool.page_head_view(p, h, part) for p in src for h, part in objects]
        landing = [pool.page_head_view(p, h, part) for p in dst for h, part in objects]
        nbytes = sum(v.numel() for v in views)
        for rep in range(repeats):
            keys = page_hashes(np.arange(rep * pages * 4, (rep + 1) * pages * 4), 4)
            names = [backend.target.object_name(KV_POOL, k, h, part)
                     for k in keys for h, part in objects]
            files = [os.path.join(store, n) for n in names]
            raw_files = [os.path.join(raw_dir, str(rep), f"{i}") for i in range(len(files))]
            os.makedirs(os.path.join(raw_dir, str(rep)), exist_ok=True)

            def put() -> None:
                _check(backend.set_from(KV_POOL, keys, src).ok, "write")

            def get() -> None:
                _check(backend.get_into(KV_POOL, keys, dst).ok, "read")

            writes = [("write", put), ("raw_write", lambda: raw.run("WRITE", views, raw_files))]
            for label, fn in _alternate(writes, rep):
                os.sync()  # each write starts with no dirty pages of the previous one
                best[label] = max(best[label], nbytes / timed(fn) / 1e9)
            reads = [("read", get), ("raw_read", lambda: raw.run("READ", landing, files))]
            for label, fn in _alternate(reads, rep):
                best[label] = max(best[label], nbytes / timed(fn) / 1e9)
            _check([torch.equal(pool.page_part_view(s, 1), pool.page_part_view(d, 1))
                    for s, d in zip(src, dst)], "round trip (bytes differ)")
            backend.delete(keys)
            shutil.rmtree(os.path.join(raw_dir, str(rep)))
        verify_s = min(timed(lambda: [xxhash.xxh3_64_intdigest(v.numpy()) for v in landing])
                       for _ in range(3))
        exists_ms = _exists_1000_ms(store)
    finally:
        raw.close()
        backend.close()
        pool.close()
        shutil.rmtree(work, ignore_errors=True)
    return {
        **bandwidth_report(best["write"], best["read"], best["raw_write"], best["raw_read"]),
        "exists_1000_ms": round(exists_ms, 3),
        "verify_ms": round(verify_s * 1e3, 3),
        "page_bytes": SPEC.page_bytes,  # K and V of one page (one object per head and part)
        "object_bytes": SPEC.page_part_bytes // SPEC.num_kv_heads,
        "layout": MemLayout.PAGE_HEAD.value,
        "pages": pages,
    }


def _check(ok: list[bool], what: str) -> None:
    if not all(ok):
        raise TransferError(f"bench storage: the nixl backend {what} failed for {ok.count(False)} "
                            "pages; see the log above, and check the disk under root_dir")


def _alternate(pair: list, rep: int) -> list:
    """kvtier first on even repeats, raw first on odd ones: neither always runs second."""
    return pair if rep % 2 == 0 else pair[::-1]


def _exists_1000_ms(store: str) -> float:
    """One `exists` over 1,000 present pages (every part stat'ed), best of 3."""
    pool = HostPool(_TINY, EXISTS_KEYS, MemLayout.PAGE_HEAD)
    backend = create_backend("nixl", StorageTarget(KeyNamespace("bench-exists")), {"root_dir": store})
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
        from nixl._api import nixl_agent, nixl_agent_config
        self.name = f"kvtier-bench-raw-{os.getpid()}"
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend(PLUGIN, dict(POSIX_PARAMS))
        self.dram = None

    def register(self, pool: HostPool) -> None:
        self.dram = self.agent.register_memory([(pool.data_ptr(), pool.nbytes, 0, "")], "DRAM",
                                               backends=[PLUGIN])

    def run(self, op: str, views: list[torch.Tensor], paths: list[str]) -> None:
        flags = os.O_RDONLY if op == "READ" else os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        fds = [os.open(p, flags, 0o600) for p in paths]
        a = self.agent
        try:
            reg = a.register_memory([(0, object_bytes(v.numel()), fd, "") for v, fd in zip(views, fds)],
                                    "FILE", backends=[PLUGIN])
            local = a.get_xfer_descs([(v.data_ptr(), v.numel(), 0) for v in views], "DRAM")
            remote = a.get_xfer_descs([(HEADER_BYTES, v.numel(), fd) for v, fd in zip(views, fds)], "FILE")
            handle = a.initialize_xfer(op, local, remote, self.name, backends=[PLUGIN])
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
