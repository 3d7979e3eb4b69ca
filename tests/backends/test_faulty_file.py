"""A FaultyBackend that follows a fault file (what `kvtier bench chaos --engine vllm` writes for
the rank clients inside vLLM's workers): the rules of the rank they name, read again whenever
the file changes, each faulted call counted in `<file>.hits`; and a rank client opened with a
`fault_file` storage option follows it."""
from __future__ import annotations

import dataclasses
import json
import time

import pytest
import torch

from kvtier.backends.base import StorageTarget, StorageUnavailable
from kvtier.backends.faulty import (FaultKind, FaultyBackend, FileRule, StorageOp, fault_hits,
                                    write_fault_file)
from kvtier.backends.registry import create_backend
from kvtier.errors import ConfigError
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.policies import MemLayout
from kvtier.storage_options import parse_storage_options
from kvtier.tiers.host_pool import HostPool

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
KEYS = [f"{i:064x}" for i in range(1, 4)]


def rank_client(rules_file: str, rank: int) -> FaultyBackend:
    """TP rank `rank` of 2's client of a simulated store, following `rules_file`, with a pool
    holding its KV head of 4 pages."""
    target = StorageTarget(KeyNamespace("m", "", "fp"), HeadRange.of_rank(2, rank, 2))
    backend = FaultyBackend(create_backend("simulated", target, {}), rules_file=rules_file)
    spec = dataclasses.replace(SPEC, num_kv_heads=1)
    backend.register_pool("kv", HostPool(spec, 4, MemLayout.PAGE_HEAD))
    return backend


def test_a_rule_faults_the_rank_it_names_while_it_stands(tmp_path):
    path = str(tmp_path / "faults.json")
    first, second = rank_client(path, 0), rank_client(path, 1)
    for b in (first, second):
        assert b.set_from("kv", KEYS, [0, 1, 2]).ok == [True] * 3
    write_fault_file(path, [FileRule(StorageOp.GET, FaultKind.ERROR, first_head=1)])
    assert first.get_into("kv", KEYS, [0, 1, 2]).ok == [True] * 3  # heads from 0: not named
    with pytest.raises(StorageUnavailable, match="injected"):
        second.get_into("kv", KEYS, [0, 1, 2])
    assert fault_hits(path) == 1
    write_fault_file(path, [FileRule(StorageOp.GET, FaultKind.DELAY, delay_s=0.2)])  # both
    started = time.monotonic()
    assert first.get_into("kv", KEYS[:1], [0]).ok == [True]
    assert second.get_into("kv", KEYS[:1], [0]).ok == [True]
    assert time.monotonic() - started >= 0.4 and fault_hits(path) == 3
    write_fault_file(path, [])  # cleared: no faults, no more hits
    assert second.get_into("kv", KEYS, [0, 1, 2]).ok == [True] * 3
    assert fault_hits(path) == 3


def test_a_missing_or_bad_file_faults_nothing(tmp_path):
    path = tmp_path / "faults.json"
    client = rank_client(str(path), 0)
    assert client.set_from("kv", KEYS, [0, 1, 2]).ok == [True] * 3
    path.write_text("{not json")
    assert client.get_into("kv", KEYS, [0, 1, 2]).ok == [True] * 3
    path.write_text(json.dumps([{"op": "get", "kind": "hang"}]))  # nobody could release it
    assert client.get_into("kv", KEYS, [0, 1, 2]).ok == [True] * 3
    assert fault_hits(str(path)) == 0


def test_the_option_is_checked_and_opens_a_following_client(tmp_path):
    from kvtier.messages import NamespaceInfo, NamespaceSpec
    from kvtier.policies import StorageBackendKind
    from kvtier.tiers.page_store import open_rank_backend

    with pytest.raises(ConfigError, match="fault_file"):
        parse_storage_options(StorageBackendKind.FILE, {"fault_file": "relative.json"})
    options = {"root_dir": str(tmp_path / "l3"), "fault_file": str(tmp_path / "f.json")}
    spec = NamespaceSpec("m", "", "fp", StorageBackendKind.FILE, options, kv_heads=2)
    for opts, follows in ((options, True), ({"root_dir": options["root_dir"]}, False)):
        client = open_rank_backend(NamespaceInfo(spec.namespace, spec, opts),
                                   HeadRange.of_rank(2, 0, 2))
        try:
            assert isinstance(client, FaultyBackend) is follows
        finally:
            client.close()
