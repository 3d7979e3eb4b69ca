"""cluster.yaml passes Ray's own cluster-config validation (the code `ray up` runs first), offline:
no ssh, no network, nothing started. And it places what the README says where it says."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[2] / "cluster.yaml"


@pytest.fixture(scope="module")
def raw() -> dict:
    with open(CLUSTER_YAML) as f:
        return yaml.safe_load(f)


@pytest.fixture(scope="module")
def prepared(raw) -> dict:
    config = prepare_config(raw)  # the local provider's single node type, Ray's defaults
    validate_config(config)  # raises on a schema violation
    return config


def _resources(commands: list[str]) -> dict:
    found = re.search(r"--resources='(\{.*?\})'", " ".join(commands))
    assert found, commands
    return json.loads(found.group(1))


def test_ray_validates_the_cluster_config(prepared) -> None:
    assert prepared["provider"]["type"] == "local"
    assert prepared["cluster_name"] == "kvtier"
    (node_type,) = prepared["available_node_types"]  # the local provider has one node type
    assert prepared["head_node_type"] == node_type


def test_placeholders_are_loopback_for_a_one_machine_trial(raw) -> None:
    assert raw["provider"]["head_ip"] == "127.0.0.1"
    assert raw["provider"]["worker_ips"] == []


def test_setup_installs_system_packages_and_kvtier_in_a_venv(prepared) -> None:
    setup = " && ".join(prepared["setup_commands"])
    assert "libibverbs1" in setup and "apt-get install" in setup
    assert "scripts/bootstrap.sh" in setup and "VENV=.venv" in setup
    assert "~/kvtier" in prepared["file_mounts"]
    assert (CLUSTER_YAML.parent / "scripts" / "bootstrap.sh").is_file()


def test_start_commands_use_the_venv_ray_and_set_the_custom_resources(prepared) -> None:
    head, workers = prepared["head_start_ray_commands"], prepared["worker_start_ray_commands"]
    for commands in (head, workers):
        ray_calls = re.findall(r"(\S*\bray) start", " ".join(commands))
        assert ray_calls and all(c == "~/kvtier/.venv/bin/ray" for c in ray_calls), ray_calls
        assert not re.search(r"\bray stop\b", " ".join(commands))  # a bare stop hits the host
    assert _resources(head) == {"kvtier_head": 1}
    assert _resources(workers).get("kvtier_instance", 0) >= 1
    assert "--head" in " ".join(head) and "--dashboard-host=127.0.0.1" in " ".join(head)
    assert "$RAY_HEAD_IP:6379" in " ".join(workers)


def test_the_network_caveat_is_spelled_out() -> None:
    text = CLUSTER_YAML.read_text()
    assert "private network" in text and "ray down" in text


def test_the_validation_is_real(raw) -> None:
    broken = dict(raw, head_start_ray_comands=raw["head_start_ray_commands"])  # a typo
    with pytest.raises(Exception, match="head_start_ray_comands"):
        validate_config(prepare_config(broken))
