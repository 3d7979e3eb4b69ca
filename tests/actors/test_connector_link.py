"""Which Ray cluster vLLM's processes join (actors/l3/connector_link.py `join`): the one they
are on, else ray_address, else RAY_ADDRESS; with none, an error naming both."""
from __future__ import annotations

import socket
import time

import pytest

from kvtier.actors.l3 import connector_link
from kvtier.actors.ray_join import GCS_PROBE_TIMEOUT_S
from kvtier.errors import ClusterJoinError, ConfigError


@pytest.fixture
def joined(monkeypatch) -> list[str]:
    """The addresses `join` asks Ray to join, in a process on no cluster, RAY_ADDRESS unset."""
    calls: list[str] = []
    monkeypatch.setattr(connector_link, "join_cluster", calls.append)
    monkeypatch.setattr(connector_link.ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_ray_address_wins_over_the_environment(joined, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    connector_link.join("10.0.0.1:6379")
    assert joined == ["10.0.0.1:6379"]


@pytest.mark.parametrize("given", [None, ""])
def test_without_ray_address_the_environment_names_the_cluster(joined, monkeypatch, given):
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")  # what Ray Serve's processes inherit
    connector_link.join(given)
    assert joined == ["10.0.0.2:6379"]


def test_with_neither_the_error_names_both(joined):
    with pytest.raises(ConfigError, match="ray_address in kv_connector_extra_config.*RAY_ADDRESS"):
        connector_link.join(None)
    assert joined == []


def test_a_process_on_a_cluster_stays_on_it(joined, monkeypatch):
    monkeypatch.setattr(connector_link.ray, "is_initialized", lambda: True)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.2:6379")
    connector_link.join("10.0.0.1:6379")
    assert joined == []


def test_a_ray_address_where_nothing_answers_fails_within_the_bound(monkeypatch):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("RAY_ADDRESS", address)
    start = time.monotonic()
    with pytest.raises(ClusterJoinError, match=address):
        connector_link.join(None)
    assert time.monotonic() - start < GCS_PROBE_TIMEOUT_S + 5
