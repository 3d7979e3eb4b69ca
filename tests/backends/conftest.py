"""Fixtures of the backend conformance suite: one factory per backend kind.

Each kind brings a `Tamper` that reaches under the interface (remove one object, corrupt or
truncate it, take the storage away) the way a crash, bit rot or an operator would.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch

from kvtier.backends.base import StorageTarget
from kvtier.backends.registry import create_backend
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import KVSpec
from kvtier.policies import MemLayout
from kvtier.tiers.host_pool import HostPool

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.bfloat16)
KINDS = ["sim", "file", "nixl", "mooncake"]


class SimTamper:
    def remove(self, backend, name):
        from kvtier.backends import simulated
        with simulated._LOCK:
            backend._store.pop(name)

    def corrupt(self, backend, name):
        blob, _ = backend._store[name]
        backend.corrupt(name, bytes([blob[0] ^ 0xFF]) + blob[1:])

    def truncate(self, backend, name):
        blob, _ = backend._store[name]
        backend.corrupt(name, blob[: len(blob) // 2])

    def take_down(self, backend):
        pytest.skip("the simulated backend has nothing to take down")


class FileTamper:
    def __init__(self, root: Path):
        self.root = root

    def path(self, name):
        return self.root / name

    def remove(self, backend, name):
        os.unlink(self.path(name))

    def corrupt(self, backend, name):
        p = self.path(name)
        data = bytearray(p.read_bytes())
        data[-7] ^= 0xFF  # a payload byte near the end
        p.write_bytes(bytes(data))

    def truncate(self, backend, name):
        p = self.path(name)
        os.truncate(p, p.stat().st_size // 2)

    def take_down(self, backend):
        import shutil
        shutil.rmtree(self.root)
        self.root.write_text("not a directory any more")


class Harness:
    """Makes backends of one kind over a shared store, and pools to move pages through."""

    def __init__(self, kind: str, tmp_path: Path, request):
        self.kind = kind
        self.tmp_path = tmp_path
        self.request = request
        self.made = []
        self.tag = uuid.uuid4().hex[:8]
        if kind == "sim":
            self.options = {"seed": int(self.tag, 16)}
            self.tamper = SimTamper()
        elif kind in ("file", "nixl"):
            pytest.importorskip(f"kvtier.backends.{kind}_backend")
            root = tmp_path / f"{kind}-l3"
            self.options = {"root_dir": str(root)}
            self.tamper = FileTamper(root)
        elif kind == "mooncake":
            pytest.importorskip("kvtier.backends.mooncake_backend")
            raise NotImplementedError("mooncake harness: wired once the backend lands")
        self.backend_kind = "simulated" if kind == "sim" else kind

    def namespace(self, tenant: str = "t0") -> KeyNamespace:
        return KeyNamespace(f"model-{self.tag}", tenant, "fp1")

    def backend(self, tenant: str = "t0", rank: int = 0, size: int = 1, options=None):
        target = StorageTarget(self.namespace(tenant), rank, size)
        b = create_backend(self.backend_kind, target, options if options is not None else self.options)
        self.made.append(b)
        return b

    def pool(self, layout=MemLayout.PAGE_FIRST, pages: int = 16) -> HostPool:
        pool = HostPool(SPEC, pages, layout)
        gen = torch.Generator().manual_seed(len(self.made))
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(pool.kv.dtype))
        return pool

    def close(self):
        for b in self.made:
            b.close()


@pytest.fixture(params=KINDS)
def harness(request, tmp_path):
    h = Harness(request.param, tmp_path, request)
    yield h
    h.close()
