"""Parked Mooncake clients stay bounded: fake clients, no Mooncake needed."""
from __future__ import annotations

from kvtier.backends.mooncake_parked import ClientSetup, ParkedClient, ParkedClients

SETUP = ClientSetup("127.0.0.1", "P2PHANDSHAKE", 256 << 20, 64 << 20, "tcp", "")


class FakeStore:
    """What ParkedClients calls on a client; `healed` says whether its master is back."""

    def __init__(self) -> None:
        self.healed = False
        self.closed = False
        self.unregistered: list[int] = []

    def unregister_buffer(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0

    def close(self) -> int:
        self.closed = True
        return 0


def registry(limit: int = 2) -> ParkedClients:
    return ParkedClients(limit, heal_wait_s=0.3, answers=lambda c: c.store.healed,
                         flag_stale_s=0.0)


def test_restarts_at_new_addresses_keep_at_most_limit_parked():
    parked = registry(limit=2)
    stores = [FakeStore() for _ in range(10)]
    for i, store in enumerate(stores):  # a master restarted on new ports, ten times
        parked.park(ParkedClient(store, f"10.0.0.1:{5000 + i}", SETUP), buffers=[0x1000, 0x2000])
        assert len(parked) <= 2
        assert parked.held_bytes() <= 2 * (SETUP.segment_bytes + SETUP.buffer_bytes)
    assert parked.stores() == stores[-2:]
    assert all(s.closed for s in stores[:-2]) and not any(s.closed for s in stores[-2:])
    assert all(s.unregistered == [0x1000, 0x2000] for s in stores)  # pools no longer pinned


def test_a_healed_client_is_reused_by_its_address_and_setup_only():
    parked = registry()
    store = FakeStore()
    parked.park(ParkedClient(store, "10.0.0.1:5000", SETUP))
    assert parked.take("10.0.0.1:5000", SETUP) is None  # not healed within heal_wait_s
    store.healed = True
    assert parked.take("10.0.0.1:5001", SETUP) is None  # another master: not this client...
    assert store.closed and len(parked) == 0  # ...but its master is back, so it was closed


def test_take_reuses_the_healed_client_and_closes_other_healed_ones():
    parked = registry(limit=4)
    mine, other, gone = FakeStore(), FakeStore(), FakeStore()
    parked.park(ParkedClient(mine, "10.0.0.1:5000", SETUP))
    parked.park(ParkedClient(other, "10.0.0.1:5000", SETUP._replace(segment_bytes=0)))
    parked.park(ParkedClient(gone, "10.0.0.2:5000", SETUP))
    mine.healed = other.healed = True
    assert parked.take("10.0.0.1:5000", SETUP) is mine and not mine.closed
    assert other.closed and not gone.closed
    assert parked.stores() == [gone]
