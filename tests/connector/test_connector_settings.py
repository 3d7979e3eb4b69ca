"""KvtierConnector's `kv_connector_extra_config`, read under SGLang's names (without vLLM)."""
from __future__ import annotations

import pytest

from kvtier.connector.settings import ConnectorSettings
from kvtier.errors import ConfigError


def test_a_file_l3_keeps_the_namespace_registry_beside_its_pages(tmp_path):
    """A namespace actor the engine starts keeps its registry beside the L3 pages, so an
    engine given another L3 directory starts another registry (a fixed one refused the new
    directory's namespace as already registered with the old directory)."""
    root = tmp_path / "kv"
    s = ConnectorSettings.from_extra_config({"hicache_storage_backend": "file",
                                             "hicache_storage_backend_extra_config":
                                                 {"root_dir": str(root)}})
    assert s.l3 and s.l3_state_dir == str(root / ".kvtier-l3-state")
    given = ConnectorSettings.from_extra_config({"hicache_storage_backend": "file",
                                                 "hicache_storage_backend_extra_config":
                                                     {"root_dir": str(root)},
                                                 "l3_state_dir": "/var/lib/kvtier"})
    assert given.l3_state_dir == "/var/lib/kvtier"
    assert ConnectorSettings.from_extra_config({}).l3_state_dir is None  # no L3


def test_unknown_keys_and_a_write_back_policy_are_refused():
    with pytest.raises(ConfigError, match="unknown kv_connector_extra_config key"):
        ConnectorSettings.from_extra_config({"hicache_ratoi": 2.0})
    with pytest.raises(ConfigError, match="write_through"):
        ConnectorSettings.from_extra_config({"hicache_write_policy": "write_back"})
    selective = ConnectorSettings.from_extra_config(
        {"hicache_write_policy": "write_through_selective"})
    assert selective.cache.write_through_hit_threshold == 2


def test_peer_transport_turns_peers_on_and_with_l3_off_uses_the_directory_alone(tmp_path):
    from kvtier.policies import Transport

    s = ConnectorSettings.from_extra_config({"peer_transport": "NIXL",
                                             "l3_state_dir": str(tmp_path)})
    assert s.peer is Transport.NIXL and not s.l3 and s.directory
    assert s.directory_root() == str(tmp_path / "kvtier-peer-directory")
    assert ConnectorSettings.from_extra_config({}).peer is None
    assert not ConnectorSettings.from_extra_config({}).directory
    with pytest.raises(ConfigError, match="nixl or mooncake"):
        ConnectorSettings.from_extra_config({"peer_transport": "simulated"})
    with pytest.raises(ConfigError, match="peer_transport"):
        ConnectorSettings.from_extra_config({"peer_transport": "rdma"})
