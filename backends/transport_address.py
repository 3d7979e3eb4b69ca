"""What `TransportEndpoint.address()` returns: a small msgpack envelope, opaque to callers.

    {"v": 1, "kind": "nixl", "name": "<endpoint name>", "pid": 1234,
     "regions": [[addr, nbytes, "cpu"], ...], "blob": <the library's own bytes>}

`blob` is what the library needs to reach the endpoint (NIXL: the agent's metadata, its UCX
worker address and registrations included; Mooncake: the session id "host:port"; simulated:
empty). The region list lets a writer reject a row outside the peer's registered memory
before any library call (the same error for every transport) and tells NIXL the peer's
memory type and GPU index, which its remote descriptors must carry. The address is taken
after the last `register()`: memory registered later is not in it.
"""
from __future__ import annotations

from typing import NamedTuple

import msgpack

from kvtier.backends.transport_regions import Region, RegionTable
from kvtier.policies import Transport

VERSION = 1


class PeerAddress(NamedTuple):
    kind: Transport
    name: str
    pid: int
    regions: tuple[Region, ...]
    blob: bytes

    def table(self) -> RegionTable:
        return RegionTable(self.regions)


def encode(address: PeerAddress) -> bytes:
    return msgpack.packb({"v": VERSION, "kind": address.kind.value, "name": address.name,
                          "pid": address.pid, "regions": [list(r) for r in address.regions],
                          "blob": address.blob}, use_bin_type=True)


def decode(data: bytes) -> PeerAddress:
    """The envelope, or ValueError saying why `data` is not one."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ValueError(f"a peer address is bytes from another endpoint's address(); "
                         f"got {type(data).__name__}")
    try:
        doc = msgpack.unpackb(bytes(data), raw=False)
        version = doc["v"]
    except Exception as exc:  # noqa: BLE001 - any malformed input is one answer
        raise ValueError(f"{len(data)} bytes that are not a transport endpoint address "
                         f"({type(exc).__name__}: {exc})") from exc
    if version != VERSION:
        raise ValueError(f"a transport address of version {version!r}; this kvtier reads {VERSION}")
    try:
        regions = tuple(Region(int(a), int(n), str(d)) for a, n, d in doc["regions"])
        return PeerAddress(Transport(doc["kind"]), str(doc["name"]), int(doc["pid"]),
                           regions, bytes(doc["blob"]))
    except Exception as exc:  # noqa: BLE001
        raise ValueError(f"{len(data)} bytes that are not a transport endpoint address "
                         f"({type(exc).__name__}: {exc})") from exc
