"""`kvtier serve`'s cache flags: SGLang's --hicache-* flags (and --hicache-config) become the
deployment's settings, checked together with kvtier's own."""
from __future__ import annotations

import argparse
import json

import pytest

from kvtier.errors import ConfigError
from kvtier.policies import StorageBackendKind
from kvtier.frontend.settings import ServeSettings
from kvtier.cli.serve_command import add_arguments, settings_from


def settings(*argv: str) -> ServeSettings:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return settings_from(parser.parse_args(list(argv)))


def test_sglang_flags_become_settings(tmp_path):
    s = settings("--page-size", "32", "--hicache-ratio", "3", "--hicache-mem-layout",
                 "page_first_direct", "--hicache-io-backend", "direct",
                 "--hicache-write-policy", "write_back", "--hicache-host-mode", "cache",
                 "--hicache-storage-prefetch-policy", "wait_complete",
                 "--hicache-load-back-threshold", "48", "--hicache-storage-backend", "file",
                 "--hicache-storage-backend-extra-config", json.dumps({"root_dir": str(tmp_path)}))
    assert (s.page_size, s.hicache_ratio, s.storage_backend, s.l3_root) == \
        (32, 3.0, StorageBackendKind.FILE, str(tmp_path))
    assert s.hicache == {"mem_layout": "page_head", "io_backend": "direct",  # L3: page_head
                         "write_policy": "write_back", "host_mode": "cache",
                         "prefetch_policy": "wait_complete", "load_back_threshold_tokens": 48}
    c = s.cache_config()
    assert (c.page_size, c.hicache_ratio, c.write_policy.value, c.load_back_threshold_tokens) == \
        (32, 3.0, "write_back", 48)
    assert ServeSettings.from_mapping(s.to_mapping()).hicache == s.hicache  # Serve config args


def test_defaults_and_the_config_file(tmp_path):
    plain = settings()
    assert (plain.hicache, plain.storage_backend, plain.page_size,
            plain.enable_hierarchical_cache) == ({}, StorageBackendKind.FILE, 64, True)
    path = tmp_path / "hicache.json"
    path.write_text(json.dumps({"write_policy": "write_through_selective", "page_size": 16}))
    s = settings("--hicache-config", f"@{path}", "--hicache-write-policy", "write_back")
    assert s.hicache == {"write_policy": "write_back"} and s.page_size == 16  # flags win
    off = settings("--disable-hierarchical-cache")
    assert not off.enable_hierarchical_cache and off.storage_backend is None
    mooncake = StorageBackendKind.MOONCAKE
    assert settings("--hicache-storage-backend", "mooncake").storage_backend is mooncake
    assert settings("--l3", "mooncake").storage_backend is mooncake  # kvtier's flag, one field
    assert settings("--l3", "none").storage_backend is None


@pytest.mark.parametrize("argv, match", [
    (["--l3", "nixl", "--hicache-storage-backend", "file"], "disagree"),
    (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
      '{"root_dir": "/tmp/a", "max_size_bytes": 4096}'], "max_size_bytes"),
    (["--l3-root", "/tmp/a", "--hicache-storage-backend", "file",
      "--hicache-storage-backend-extra-config", '{"root_dir": "/tmp/b"}'], "disagree"),
    (["--disable-radix-cache", "--disable-hierarchical-cache"], "prefix cache"),
    (["--hicache-write-policy", "sometimes"], "write_policy"),
])
def test_conflicts_and_bad_values_are_refused(argv, match):
    with pytest.raises(ConfigError, match=match):
        settings(*argv)


def test_the_settings_own_page_size_ratio_and_l3():
    with pytest.raises(ConfigError, match="'page_size' setting"):
        ServeSettings(hicache={"page_size": 32})
    with pytest.raises(ConfigError, match="'storage_backend' setting"):
        ServeSettings(hicache={"storage_backend": "file"})
    with pytest.raises(ConfigError, match="writ_policy"):
        ServeSettings(hicache={"writ_policy": "write_back"})
    with pytest.raises(ConfigError, match="hicache"):
        ServeSettings(hicache=["write_back"])


def test_an_l3_takes_the_page_head_layout():
    """An L3 stores each KV head of a page part as one contiguous object, which only page_head
    gives; the ranks attach L3 later, so the deployment's config is normalized for it."""
    with_l3 = settings("--hicache-mem-layout", "layer_first")
    assert with_l3.cache_config().mem_layout.value == "page_head"
    assert with_l3.cache_config().storage_backend is None  # attached by the namespace actor
    alone = settings("--hicache-mem-layout", "layer_first", "--l3", "none")
    assert alone.cache_config().mem_layout.value == "layer_first"


def test_l3_max_gb_bounds_a_file_namespace():
    from kvtier.actors.serve_instance import l3_options
    from kvtier.policies import StorageBackendKind

    s = settings("--l3-max-gb", "2", "--l3-root", "/tmp/kvtier-l3")
    assert l3_options(StorageBackendKind.FILE, s, None) == {"root_dir": "/tmp/kvtier-l3",
                                                          "max_size_bytes": 2 << 30}
    for unbounded in ("unbounded", "0"):  # asked for: no bound
        s = settings("--l3-max-gb", unbounded, "--l3-root", "/tmp/x")
        assert "max_size_bytes" not in l3_options(StorageBackendKind.FILE, s, None)
    with pytest.raises(ConfigError, match="l3_max_gb"):
        settings("--l3", "mooncake", "--l3-max-gb", "1")
    mooncake = settings("--l3", "mooncake")  # auto: its master bounds it, nothing to measure
    assert mooncake.with_l3_bound() == mooncake
    assert "max_size_bytes" not in l3_options(StorageBackendKind.MOONCAKE, mooncake, None)
    for bad in ("-1", "lots", "nan"):
        with pytest.raises(ConfigError, match="l3_max_gb"):
            settings("--l3-max-gb", bad)


def test_the_request_timeout_flag():
    assert settings().request_timeout_s == 300.0
    assert settings("--request-timeout-s", "30").request_timeout_s == 30.0
    with pytest.raises(ConfigError, match="request_timeout_s"):
        settings("--request-timeout-s", "0")


def test_engine_vllm_takes_smollm2_or_a_directory_and_refuses_what_it_lacks(tmp_path):
    """`--engine vllm`: what a vLLM instance cannot do is refused when the graph is built,
    naming the setting; the kvtier engine stays the default."""
    from kvtier.actors.serve_vllm import connector_config, event_namespace
    from kvtier.frontend.settings import EngineKind

    assert settings().engine is EngineKind.KVTIER
    s = settings("--engine", "vllm", "--hicache-storage-prefetch-policy", "timeout",
                 "--l3-root", str(tmp_path))
    assert s.engine is EngineKind.VLLM
    assert ServeSettings.from_mapping(s.to_mapping()).engine is EngineKind.VLLM
    assert event_namespace(s).model == "vllm/SmolLM2-135M-Instruct"
    extra = connector_config(s, "127.0.0.1:6379")
    assert extra["hicache_storage_prefetch_policy"] == "timeout"
    assert extra["hicache_storage_backend"] == "file" and extra["ray_address"] == "127.0.0.1:6379"
    assert json.loads(extra["hicache_storage_backend_extra_config"])["root_dir"] == str(tmp_path)
    assert "peer_transport" not in extra
    peers = connector_config(settings("--engine", "vllm", "--l3", "none", "--peer-transport",
                                      "nixl"), "127.0.0.1:6379")  # the engines read each other
    assert peers["peer_transport"] == "nixl" and "hicache_storage_backend" not in peers
    for argv, needle in [(["--model", "tiny"], "not one vLLM loads"),
                         (["--tenant-salt", "x"], "tenant_salt is not supported"),
                         (["--deterministic"], "deterministic is not supported"),
                         (["--prefill-instances", "1", "--decode-instances", "1"],
                          "prefill_instances is not supported")]:
        with pytest.raises(ConfigError, match=needle):
            settings("--engine", "vllm", *argv)
    with pytest.raises(ConfigError, match="mem_layout"):  # a knob of kvtier's engine only
        connector_config(settings("--engine", "vllm", "--hicache-mem-layout", "page_first"),
                         None)
