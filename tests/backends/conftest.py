"""Fixtures of the backend conformance suite: one factory per backend kind.

Each kind brings a `Tamper` that reaches under the interface (remove one object, corrupt or
truncate it, take the storage away) the way a crash, bit rot or an operator would.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from pathlib import Path

import pytest
import torch

from kvtier.backends.base import StorageTarget
from kvtier.backends.registry import create_backend
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import HeadRange, KVSpec
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


class MooncakeTamper:
    """Reaches objects through the backend's own Mooncake client."""

    def __init__(self, master):
        self.master = master
        self._scratch = []  # registered buffers must outlive the client

    def remove(self, backend, name):
        backend.store.remove(name, True)

    def _rewrite(self, backend, name, change):
        import numpy as np
        size = backend.store.get_size(name)
        buf = np.zeros(size, dtype=np.uint8)
        self._scratch.append(buf)
        backend.store.register_buffer(buf.ctypes.data, size)
        assert backend.store.batch_get_into([name], [buf.ctypes.data], [size]) == [size]
        data = change(buf)
        backend.store.remove(name, True)
        assert backend.store.batch_put_from([name], [data.ctypes.data], [data.nbytes]) == [0]

    def corrupt(self, backend, name):
        def flip(buf):
            buf[-7] ^= 0xFF
            return buf
        self._rewrite(backend, name, flip)

    def truncate(self, backend, name):
        self._rewrite(backend, name, lambda buf: buf[: buf.size // 2])

    def take_down(self, backend):
        self.master.stop()


@pytest.fixture(scope="session")
def mooncake_cluster():
    """One master and one 'holder' client whose segment keeps objects across client closes."""
    pytest.importorskip("kvtier.backends.mooncake_backend")
    from kvtier.backends.mooncake_master import MooncakeMaster

    with MooncakeMaster() as master:
        holder = _mooncake_holder(master)
        yield master
        holder.close()


def _mooncake_holder(master):
    target = StorageTarget(KeyNamespace("holder"))
    return create_backend("mooncake", target, {"master_address": master.address,
                                                "global_segment_size_bytes": 64 << 20})


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
            if request.node.get_closest_marker("takes_down"):  # a private master to kill
                from kvtier.backends.mooncake_master import MooncakeMaster
                master = MooncakeMaster()
                self.holder = _mooncake_holder(master)
                self.private_master = master
            else:
                master = request.getfixturevalue("mooncake_cluster")
            # objects live in the holder's segment, so they outlive the test's clients
            self.options = {"master_address": master.address, "verify_checksums": True,
                            "global_segment_size_bytes": 0, "local_buffer_size_bytes": 0}
            self.tamper = MooncakeTamper(master)
        self.backend_kind = "simulated" if kind == "sim" else kind

    def namespace(self, tenant: str = "t0") -> KeyNamespace:
        return KeyNamespace(f"model-{self.tag}", tenant, "fp1")

    def backend(self, tenant: str = "t0", rank: int = 0, size: int = 1, options=None):
        """A client owning TP rank `rank` of `size`'s share of SPEC's KV heads."""
        target = StorageTarget(self.namespace(tenant),
                               HeadRange.of_rank(SPEC.num_kv_heads, rank, size))
        b = create_backend(self.backend_kind, target, options if options is not None else self.options)
        self.made.append(b)
        return b

    def pool(self, layout=MemLayout.PAGE_HEAD, pages: int = 16, size: int = 1) -> HostPool:
        """A pool of random pages holding one TP rank of `size`'s share of the KV heads."""
        spec = dataclasses.replace(SPEC, num_kv_heads=SPEC.num_kv_heads // size)
        pool = HostPool(spec, pages, layout)
        gen = torch.Generator().manual_seed(len(self.made))
        pool.kv.copy_(torch.randn(pool.kv.shape, generator=gen).to(pool.kv.dtype))
        return pool

    def close(self):
        for b in self.made:
            b.close()
        if getattr(self, "private_master", None) is not None:
            self.holder.close()
            self.private_master.stop()


@pytest.fixture(params=KINDS)
def harness(request, tmp_path):
    h = Harness(request.param, tmp_path, request)
    yield h
    h.close()
