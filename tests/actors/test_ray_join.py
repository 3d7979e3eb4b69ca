"""Joining a Ray cluster (actors/ray_join.py): an address where no Ray answers fails within
GCS_PROBE_TIMEOUT_S with an error naming it, instead of Ray retrying it for many minutes."""
from __future__ import annotations

import socket
import threading
import time

import pytest
import ray

from kvtier.actors.ray_join import GCS_PROBE_TIMEOUT_S, gcs_silence, join_cluster
from kvtier.errors import ClusterJoinError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_fails(address: str) -> ClusterJoinError:
    """What joining `address` raised, checked to come within the bound."""
    assert not ray.is_initialized()
    start = time.monotonic()
    with pytest.raises(ClusterJoinError) as info:
        join_cluster(address)
    assert time.monotonic() - start < GCS_PROBE_TIMEOUT_S + 5
    assert address in str(info.value) and not ray.is_initialized()
    return info.value


def test_an_address_where_nothing_listens_fails_at_once():
    address = f"127.0.0.1:{free_port()}"
    start = time.monotonic()
    assert "cannot connect" in str(join_fails(address))
    assert time.monotonic() - start < 2  # refused: no waiting at all


class Server:
    """A TCP server on 127.0.0.1 that answers each connection with `reply` (None: silence)."""

    def __init__(self, reply: bytes | None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply, self.conns = reply, []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if self.reply is not None:
                conn.recv(64)
                conn.sendall(self.reply)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def test_a_server_that_is_not_a_gcs_fails_within_the_bound():
    """The dashboard's port (HTTP/1.1), or a server that says nothing."""
    http, mute = Server(b"HTTP/1.1 400 Bad Request\r\n\r\n"), Server(None)
    try:
        assert "not Ray's GCS" in str(join_fails(http.address))
        start = time.monotonic()
        assert gcs_silence(mute.address, timeout_s=0.5) == "no answer within 0.5 s"
        assert time.monotonic() - start < 2
    finally:
        http.close()
        mute.close()


def test_addresses_that_are_not_host_and_port_are_left_to_ray():
    assert gcs_silence("auto") is None
    assert gcs_silence("ray://127.0.0.1:1") is None


def test_a_grpc_server_answers_the_probe():
    """Ray's GCS is a gRPC server: any answers the greeting with its own (a real cluster's
    GCS is joined in test_cluster_placement.py)."""
    from concurrent import futures

    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert gcs_silence(f"127.0.0.1:{port}") is None
    finally:
        server.stop(None)
