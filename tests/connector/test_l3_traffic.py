"""A worker's L3 traffic through the real file backend: its heads' objects written from one
host pool and read into others, at another TP size too."""
from __future__ import annotations

import time
from concurrent.futures import Future

import torch

from kvtier.backends.base import PagesStillInUse
from kvtier.backends.registry import create_backend
from kvtier.backends.object_names import StorageTarget
from kvtier.connector.l3_traffic import L3Traffic, TrafficResults
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import HeadRange

NS = KeyNamespace("m", layout_fingerprint="vllm")
SLOTS, HEADS, LAYERS, VALUES = 4, 2, 3, 16


def traffic(root: str, heads: HeadRange, host: torch.Tensor, reported: list) -> L3Traffic:
    backend = create_backend("file", StorageTarget(NS, heads), {"root_dir": root})
    return L3Traffic(backend, host, reported.extend)


def settled(t: L3Traffic, count: int) -> TrafficResults:
    """What `t` finished, once `count` slots did (bounded)."""
    got = TrafficResults()
    deadline = time.monotonic() + 30
    while len(got.stored) + len(got.fetched) + len(got.failed_fetches) < count:
        assert time.monotonic() < deadline, "the L3 thread did not finish"
        more = t.take()
        got.stored += more.stored
        got.fetched += more.fetched
        got.failed_fetches += more.failed_fetches
        time.sleep(0.01)
    return got


def test_pages_written_at_tp1_are_read_by_two_tp2_ranks(tmp_path):
    keys = NS.page_hashes(list(range(8)), 4)
    host = torch.randn(SLOTS, HEADS, 2, LAYERS, VALUES).to(torch.bfloat16)
    reported: list[str] = []
    writer = traffic(str(tmp_path), HeadRange(0, 2, 2), host, reported)
    writer.store(keys, [3, 1])
    assert sorted(settled(writer, 2).stored) == [1, 3] and reported == keys
    for rank in (0, 1):
        mine = torch.zeros(SLOTS, 1, 2, LAYERS, VALUES, dtype=torch.bfloat16)
        reader = traffic(str(tmp_path), HeadRange.of_rank(2, rank, 2), mine, [])
        reader.fetch(keys, [0, 2], gen=7)
        assert sorted(settled(reader, 2).fetched) == [(0, 7), (2, 7)]
        assert torch.equal(mine[0, 0], host[3, rank]) and torch.equal(mine[2, 0], host[1, rank])
        reader.close()
    writer.close()


def test_a_corrupt_or_missing_object_is_a_failed_fetch(tmp_path):
    keys = NS.page_hashes(list(range(12)), 4)
    host = torch.randn(SLOTS, HEADS, 2, LAYERS, VALUES).to(torch.bfloat16)
    writer = traffic(str(tmp_path), HeadRange(0, 2, 2), host, [])
    writer.store(keys[:2], [0, 1])
    settled(writer, 2)
    victim = next(p for p in tmp_path.rglob("*") if p.is_file() and keys[1] in p.name)
    victim.write_bytes(b"\0" * victim.stat().st_size)  # same size, wrong bytes
    writer.fetch(keys, [2, 3, 0], gen=1)  # page 2 was never written
    got = settled(writer, 3)
    assert got.fetched == [(2, 1)] and sorted(got.failed_fetches) == [(0, 1), (3, 1)]
    writer.close()


class StuckReads:
    """A backend whose reads give up while the storage may still write their pages: the
    call returns when the test says (`PagesStillInUse` with its pending call)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.capabilities = backend.capabilities
        self.call: Future = Future()

    def register_pool(self, *args, **kwargs):
        return self.backend.register_pool(*args, **kwargs)

    def get_into(self, *args, **kwargs):
        raise PagesStillInUse("the read timed out and the transfer may still land",
                              pending=self.call)

    def set_from(self, *args, **kwargs):
        return self.backend.set_from(*args, **kwargs)

    def close(self):
        self.backend.close()


def test_a_read_that_may_still_write_its_slots_holds_them_until_its_call_returns(tmp_path):
    keys = NS.page_hashes(list(range(8)), 4)
    host = torch.zeros(SLOTS, HEADS, 2, LAYERS, VALUES, dtype=torch.bfloat16)
    stuck = StuckReads(create_backend("file", StorageTarget(NS, HeadRange(0, 2, 2)),
                                      {"root_dir": str(tmp_path)}))
    t = L3Traffic(stuck, host, [].extend)
    t.fetch(keys, [1, 2], gen=3)
    deadline = time.monotonic() + 30
    got = t.take()
    while not got.held_fetches:
        assert time.monotonic() < deadline and not got.failed_fetches and not got.fetched
        time.sleep(0.01)
        got = t.take()
    assert got.held_fetches == [(1, 3), (2, 3)] and t.quarantined == 1
    assert t.take() == TrafficResults()  # held: nothing more until the call returns
    stuck.call.set_result(None)
    assert t.take().released == [(1, 3), (2, 3)] and t.quarantined == 0
    t.close()
