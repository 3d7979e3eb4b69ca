"""HiCacheConfig, its normalization, the storage options and the CLI flags."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import kvtier.config as config_mod
from kvtier.config import HiCacheConfig, knob_names
from kvtier.errors import ConfigError
from kvtier.cli.flags import add_hicache_flags, config_from_args, load_mapping_file
from kvtier.policies import (HostMode, IoBackend, MemLayout, PrefetchPolicy,
                             StorageBackendKind, WritePolicy)
from kvtier.storage_options import (FileOptions, MooncakeOptions, MooncakeProtocol,
                                    NixlOptions, NixlPlugin, SimulatedOptions,
                                    parse_storage_options)


@pytest.fixture(autouse=True)
def _fresh_log_memory():
    config_mod._reset_logged_for_tests()
    yield
    config_mod._reset_logged_for_tests()


def _adjust_records(caplog):
    return [r for r in caplog.records if r.name == "kvtier.config" and r.levelno == logging.INFO]


def cli(*argv: str) -> HiCacheConfig:
    parser = argparse.ArgumentParser()
    add_hicache_flags(parser)
    return config_from_args(parser.parse_args(list(argv)))


# ---- defaults and derived values ---------------------------------------------------------

def test_defaults_match_the_reference():
    c = HiCacheConfig()
    assert (c.page_size, c.hicache_ratio, c.hicache_size_gb) == (64, 2.0, 0.0)
    assert c.enable_hierarchical_cache and not c.disable_radix_cache
    assert c.write_policy is WritePolicy.WRITE_THROUGH and c.io_backend is IoBackend.KERNEL
    assert c.mem_layout is MemLayout.PAGE_FIRST and c.host_mode is HostMode.CACHE
    assert c.prefetch_policy is PrefetchPolicy.TIMEOUT
    assert (c.prefetch_threshold_tokens, c.load_back_threshold_tokens) == (256, 10)
    assert (c.prefetch_capacity_ratio, c.storage_batch_pages) == (0.5, 128)
    assert c.storage_backend is None and c.storage_options is None
    assert c.normalize() == c and c.normalize().adjustments == ()


@pytest.mark.parametrize("policy, threshold", [("write_through", 1),
                                               ("write_through_selective", 2),
                                               ("write_back", None)])
def test_write_through_hit_threshold(policy, threshold):
    assert HiCacheConfig(write_policy=policy).write_through_hit_threshold == threshold


def test_prefetch_timeout_formula():
    c = HiCacheConfig()
    assert c.prefetch_timeout_s(0) == 2.0
    assert c.prefetch_timeout_s(10 * 1024) == pytest.approx(3.0)
    assert c.prefetch_timeout_s(10**7) == 30.0
    with pytest.raises(ValueError):
        c.prefetch_timeout_s(-1)


def test_host_pool_bytes_ratio_or_size():
    assert HiCacheConfig().host_pool_bytes(1000) == 2000
    assert HiCacheConfig(hicache_size_gb=1.5).host_pool_bytes(1000) == 1_500_000_000


def test_frozen_and_hashable():
    c = HiCacheConfig(storage_backend="file")
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.page_size = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.storage_options.root_dir = "/x"  # type: ignore[misc]
    assert hash(c) == hash(HiCacheConfig(storage_backend=StorageBackendKind.FILE))


# ---- normalization -----------------------------------------------------------------------

RULES = [
    (dict(mem_layout="page_first_direct", io_backend="kernel"),
     dict(io_backend=IoBackend.DIRECT), "kernel -> direct"),
    (dict(mem_layout="page_first", io_backend="direct"),
     dict(mem_layout=MemLayout.PAGE_FIRST_DIRECT), "page_first -> page_first_direct"),
    (dict(storage_backend="mooncake", mem_layout="layer_first"),
     dict(mem_layout=MemLayout.PAGE_HEAD), "layer_first -> page_head"),
    (dict(storage_backend="file", mem_layout="layer_first"),
     dict(mem_layout=MemLayout.PAGE_HEAD), "the file backend stores each KV head"),
    (dict(storage_backend="nixl", mem_layout="page_first_direct", io_backend="direct"),
     dict(mem_layout=MemLayout.PAGE_HEAD), "page_first_direct -> page_head"),
    (dict(page_size=512), dict(prefetch_threshold_tokens=512), "256 -> 512"),
    (dict(hicache_size_gb=8), dict(hicache_ratio=0.0), "--hicache-size 8 GB overrides"),
]


@pytest.mark.parametrize("fields, expected, note", RULES)
def test_each_rule_applies_is_recorded_and_logged_once(fields, expected, note, caplog):
    caplog.set_level(logging.INFO, logger="kvtier.config")
    before = HiCacheConfig(**fields)
    after = before.normalize()
    for name, value in expected.items():
        assert getattr(after, name) == value
    assert any(note in a for a in after.adjustments), after.adjustments
    HiCacheConfig(**fields).normalize()  # the same adjustment again: not logged again
    assert [note in r.getMessage() for r in _adjust_records(caplog)].count(True) == 1
    config_mod._reset_logged_for_tests()
    before.normalize()
    assert [note in r.getMessage() for r in _adjust_records(caplog)].count(True) == 2


@pytest.mark.parametrize("fields, expected, note", RULES)
def test_normalization_is_idempotent(fields, expected, note):
    once = HiCacheConfig(**fields).normalize()
    twice = once.normalize()
    assert twice == once and twice.to_dict() == once.to_dict()
    assert twice.adjustments == ()


def test_l3_takes_page_head_whatever_the_io_backend():
    for io in IoBackend:
        c = HiCacheConfig.normalized(storage_backend="mooncake", mem_layout="layer_first",
                                     io_backend=io)
        assert c.mem_layout is MemLayout.PAGE_HEAD and c.io_backend is io
        assert len(c.adjustments) == 1 and c.normalize().adjustments == ()
    kept = HiCacheConfig.normalized(storage_backend="file", mem_layout="page_head")
    assert kept.mem_layout is MemLayout.PAGE_HEAD and kept.adjustments == ()
    assert HiCacheConfig(mem_layout="page_first").normalize_for_l3("file").mem_layout \
        is MemLayout.PAGE_HEAD


def test_page_first_kernel_and_layer_first_direct_are_left_alone():
    for fields in (dict(io_backend="kernel"), dict(mem_layout="layer_first", io_backend="direct")):
        assert HiCacheConfig(**fields).normalize().adjustments == ()


def test_describe_shows_effective_values():
    c = HiCacheConfig(mem_layout="page_first", io_backend="direct", storage_backend="file",
                      hicache_size_gb=4)
    text = c.describe()
    assert "layout=page_head" in text and "io=direct" in text
    assert "host=4GB/rank" in text and "storage=file(root_dir=/tmp/kvtier-l3" in text
    assert str(c) == text and "\n" not in text
    assert "hicache off" in HiCacheConfig(enable_hierarchical_cache=False).describe()


# ---- conflicts and bad values ------------------------------------------------------------

CONFLICTS = [
    (dict(disable_radix_cache=True), ["--disable-radix-cache", "--disable-hierarchical-cache"]),
    (dict(host_mode="storage_only"), ["--hicache-host-mode", "--hicache-storage-backend"]),
    (dict(host_mode="storage_only", storage_backend="file", write_policy="write_back"),
     ["--hicache-host-mode", "--hicache-write-policy", "write_through"]),
    (dict(hicache_ratio=1.0), ["--hicache-ratio", "--hicache-size"]),
    (dict(hicache_ratio=0.5), ["--hicache-ratio", "above 1.0"]),
    (dict(hicache_ratio=-3.0), ["--hicache-ratio"]),
    (dict(hicache_size_gb=-1.0), ["--hicache-size"]),
    (dict(page_size=0), ["--page-size"]),
    (dict(page_size=-64), ["--page-size"]),
    (dict(page_size=48), ["--page-size", "power of two"]),
    (dict(page_size=8192), ["--page-size", "4096"]),
    (dict(prefetch_timeout_base_s=-1.0), ["prefetch_timeout_base_s"]),
    (dict(prefetch_timeout_per_ki_token_s=-0.1), ["prefetch_timeout_per_ki_token_s"]),
    (dict(prefetch_timeout_base_s=10.0, prefetch_timeout_max_s=5.0),
     ["prefetch_timeout_max_s", "prefetch_timeout_base_s", "prefetch_timeout_max"]),
    (dict(prefetch_capacity_ratio=0.0), ["prefetch_capacity_ratio", "(0, 1]"]),
    (dict(prefetch_capacity_ratio=1.5), ["prefetch_capacity_ratio"]),
    (dict(storage_batch_pages=0), ["storage_batch_pages"]),
    (dict(load_back_threshold_tokens=-1), ["--hicache-load-back-threshold"]),
    (dict(prefetch_threshold_tokens=-1), ["prefetch_threshold_tokens"]),
    (dict(storage_options={"root_dir": "/x"}), ["--hicache-storage-backend-extra-config",
                                                "--hicache-storage-backend"]),
    (dict(storage_options=FileOptions()), ["--hicache-storage-backend"]),
    (dict(storage_backend="file", storage_options=NixlOptions()), ["FileOptions"]),
    (dict(storage_backend="file", enable_hierarchical_cache=False),
     ["--hicache-storage-backend", "--disable-hierarchical-cache"]),
    (dict(storage_backend="hf3fs"), ["--hicache-storage-backend", "does not ship",
                                     "file, mooncake, nixl, simulated"]),
    (dict(storage_backend="redis"), ["--hicache-storage-backend", "file, mooncake"]),
    (dict(write_policy="write_sometimes"), ["--hicache-write-policy", "write_back"]),
]


@pytest.mark.parametrize("fields, words", CONFLICTS)
def test_conflicts_name_the_flags(fields, words):
    with pytest.raises(ConfigError) as err:
        HiCacheConfig.from_dict(fields)
    for word in words:
        assert word in str(err.value)


def test_ratio_is_free_when_size_is_given():
    assert HiCacheConfig(hicache_size_gb=2, hicache_ratio=0.5).hicache_ratio == 0.5


@pytest.mark.parametrize("name, value", [
    ("page_size", True), ("page_size", "64"), ("page_size", 64.0), ("page_size", None),
    ("storage_batch_pages", False), ("hicache_ratio", "2"), ("hicache_ratio", True),
    ("hicache_ratio", math.nan), ("hicache_ratio", math.inf), ("hicache_size_gb", 10**400),
    ("enable_hierarchical_cache", 1), ("disable_radix_cache", "yes"),
    ("write_policy", 3), ("io_backend", None), ("mem_layout", ["page_first"]),
    ("prefetch_policy", WritePolicy.WRITE_BACK), ("storage_backend", 1),
    ("storage_options", [1, 2]),
])
def test_bad_types_are_config_errors(name, value):
    fields = {name: value}
    if name == "storage_options":
        fields["storage_backend"] = "file"
    with pytest.raises(ConfigError, match=name):
        HiCacheConfig.from_dict(fields)


def test_floats_accept_ints_and_enums_accept_spellings():
    c = HiCacheConfig.from_dict({"hicache_ratio": 3, "write_policy": "Write-Through-Selective",
                                 "storage_backend": "FILE", "prefetch_policy": "best_effort"})
    assert isinstance(c.hicache_ratio, float) and c.hicache_ratio == 3.0
    assert c.write_policy is WritePolicy.WRITE_THROUGH_SELECTIVE
    assert c.storage_backend is StorageBackendKind.FILE
    assert c.prefetch_policy is PrefetchPolicy.BEST_EFFORT


def test_unknown_top_level_key_names_it_and_lists_valid_keys():
    with pytest.raises(ConfigError) as err:
        HiCacheConfig.from_dict({"page_sise": 64})
    msg = str(err.value)
    assert "'page_sise'" in msg and "did you mean 'page_size'" in msg and "hicache_ratio" in msg
    with pytest.raises(ConfigError, match="adjustments"):
        HiCacheConfig.from_dict({"adjustments": ()})
    with pytest.raises(ConfigError, match="strings"):
        HiCacheConfig.from_dict({1: 2})
    with pytest.raises(ConfigError, match="mapping"):
        HiCacheConfig.from_dict([("page_size", 64)])  # type: ignore[arg-type]


# ---- storage options ---------------------------------------------------------------------

@pytest.mark.parametrize("kind, cls", [("file", FileOptions), ("mooncake", MooncakeOptions),
                                       ("nixl", NixlOptions), ("simulated", SimulatedOptions)])
def test_each_backend_gets_default_options_and_rejects_unknown_keys(kind, cls):
    c = HiCacheConfig(storage_backend=kind)
    assert c.storage_options == cls() and hash(c.storage_options) == hash(cls())
    with pytest.raises(ConfigError) as err:
        parse_storage_options(StorageBackendKind(kind), {"bogus_key": 1})
    assert "'bogus_key'" in str(err.value) and kind in str(err.value)
    with pytest.raises(ConfigError, match="bogus_key"):
        HiCacheConfig.from_dict({"storage_backend": kind, "storage_options": {"bogus_key": 1}})


def test_option_values_parse_to_enums():
    m = parse_storage_options(StorageBackendKind.MOONCAKE, {
        "protocol": "RDMA", "master_address": "10.0.0.1:50051", "device_name": "mlx5_0",
        "metadata_server": "http://10.0.0.1:8080/metadata", "global_segment_size_bytes": 0})
    assert m.protocol is MooncakeProtocol.RDMA
    n = parse_storage_options(StorageBackendKind.NIXL, {"plugin": "ucx", "root_dir": "/data/kv"})
    assert n.plugin is NixlPlugin.UCX and n.plugin.value == "UCX"
    s = parse_storage_options(StorageBackendKind.SIMULATED, {"bandwidth_gbps": 2, "seed": 7})
    assert s.bandwidth_gbps == 2.0 and isinstance(s.bandwidth_gbps, float)


@pytest.mark.parametrize("kind, options, word", [
    ("file", {"root_dir": "relative/dir"}, "absolute"),
    ("file", {"root_dir": "/tmp/a\x00b"}, "root_dir"),
    ("file", {"root_dir": 7}, "root_dir"),
    ("file", {"max_size_bytes": -1}, "max_size_bytes"),
    ("file", {"max_size_bytes": 2 * 2**50}, "max_size_bytes"),
    ("file", {"max_size_bytes": 1.0}, "max_size_bytes"),
    ("file", {"fsync": "yes"}, "fsync"),
    ("mooncake", {"master_address": "host name:1"}, "master_address"),
    ("mooncake", {"master_address": "http://host:1"}, "master_address"),
    ("mooncake", {"local_hostname": ""}, "local_hostname"),
    ("mooncake", {"local_hostname": "a" * 300}, "local_hostname"),
    ("mooncake", {"protocol": "udp"}, "protocol"),
    ("mooncake", {"device_name": "mlx5 0"}, "device_name"),
    ("mooncake", {"metadata_server": "http://a b"}, "metadata_server"),
    ("mooncake", {"global_segment_size_bytes": True}, "global_segment_size_bytes"),
    ("mooncake", {"local_buffer_size_bytes": 10**18}, "local_buffer_size_bytes"),
    ("nixl", {"plugin": "GDS"}, "plugin"),
    ("nixl", {"root_dir": "~/kv"}, "root_dir"),
    ("simulated", {"bandwidth_gbps": 0}, "bandwidth_gbps"),
    ("simulated", {"latency_s": -1}, "latency_s"),
    ("simulated", {"capacity_pages": -5}, "capacity_pages"),
    ("simulated", {"seed": "1"}, "seed"),
])
def test_bad_option_values(kind, options, word):
    with pytest.raises(ConfigError, match=word):
        parse_storage_options(StorageBackendKind(kind), options)


def test_options_object_is_accepted_for_its_own_backend():
    opts = FileOptions(root_dir="/data/l3", fsync=True)
    assert HiCacheConfig(storage_backend="file", storage_options=opts).storage_options is opts


# ---- round trip --------------------------------------------------------------------------

@pytest.mark.parametrize("fields", [
    {}, dict(storage_backend="file", storage_options={"root_dir": "/d", "fsync": True}),
    dict(storage_backend="mooncake", storage_options={"protocol": "rdma"}, hicache_size_gb=3),
    dict(storage_backend="nixl", storage_options={"plugin": "UCX"}, host_mode="storage_only"),
    dict(storage_backend="simulated", write_policy="write_back", page_size=1),
    dict(enable_hierarchical_cache=False, disable_radix_cache=True),
])
def test_to_dict_from_dict_round_trip(fields):
    for c in (HiCacheConfig(**fields), HiCacheConfig(**fields).normalize()):
        data = json.loads(json.dumps(c.to_dict()))
        assert list(data) == knob_names()
        assert HiCacheConfig.from_dict(data) == c


# ---- files and the CLI -------------------------------------------------------------------

def _write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


CONFIG_FILES = {
    "c.json": json.dumps({"page_size": 32, "hicache_ratio": 3, "write_policy": "write_back",
                          "storage_backend": "file",
                          "storage_options": {"root_dir": "/data/l3"}}),
    "c.toml": 'page_size = 32\nhicache_ratio = 3\nwrite_policy = "write_back"\n'
              'storage_backend = "file"\n[storage_options]\nroot_dir = "/data/l3"\n',
    "c.yaml": "page_size: 32\nhicache_ratio: 3\nwrite_policy: write_back\n"
              "storage_backend: file\nstorage_options:\n  root_dir: /data/l3\n",
    "c.yml": "page_size: 32\nhicache_ratio: 3\nwrite_policy: write_back\n"
             "storage_backend: file\nstorage_options: {root_dir: /data/l3}\n",
}


@pytest.mark.parametrize("name", sorted(CONFIG_FILES))
def test_config_file_formats_and_flag_override(tmp_path, name):
    path = _write(tmp_path, name, CONFIG_FILES[name])
    c = cli("--hicache-config", "@" + path)
    assert (c.page_size, c.hicache_ratio, c.write_policy) == (32, 3.0, WritePolicy.WRITE_BACK)
    assert c.storage_options == FileOptions(root_dir="/data/l3")
    c = cli("--hicache-config", path, "--page-size", "16", "--hicache-write-policy",
            "write_through")
    assert (c.page_size, c.write_policy, c.hicache_ratio) == (16, WritePolicy.WRITE_THROUGH, 3.0)


def test_config_file_unknown_key_names_the_file(tmp_path):
    path = _write(tmp_path, "c.json", '{"page_size": 32, "ratio": 2}')
    with pytest.raises(ConfigError) as err:
        cli("--hicache-config", "@" + path)
    assert path in str(err.value) and "'ratio'" in str(err.value)


@pytest.mark.parametrize("name, text, word", [
    ("c.ini", "[x]", "unsupported file type"), ("c", "{}", "unsupported file type"),
    ("c.json", "[1, 2]", "object"), ("c.yaml", "- 1\n- 2\n", "object"),
    ("c.yaml", "", "object"), ("c.json", "{nope", "invalid JSON"),
    ("c.toml", "a = ", "invalid TOML"), ("c.yaml", "a: [1", "invalid YAML"),
])
def test_bad_files_name_the_path(tmp_path, name, text, word):
    path = _write(tmp_path, name, text)
    for flag in ("--hicache-config", "--hicache-storage-backend-extra-config"):
        with pytest.raises(ConfigError) as err:
            cli("--hicache-storage-backend", "file", flag, "@" + path)
        assert path in str(err.value) and word in str(err.value) and flag in str(err.value)


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not found") as err:
        load_mapping_file(missing, "--hicache-config")
    assert missing in str(err.value)


def test_cli_defaults_and_flags():
    assert cli() == HiCacheConfig()
    c = cli("--page-size", "128", "--hicache-ratio", "4", "--hicache-io-backend", "direct",
            "--hicache-storage-backend", "nixl", "--hicache-storage-prefetch-policy",
            "wait_complete", "--hicache-host-mode", "storage_only",
            "--hicache-load-back-threshold", "0")
    assert c.page_size == 128 and c.hicache_ratio == 4.0 and c.prefetch_threshold_tokens == 256
    assert c.mem_layout is MemLayout.PAGE_HEAD and c.io_backend is IoBackend.DIRECT
    assert c.storage_options == NixlOptions() and c.host_mode is HostMode.STORAGE_ONLY
    assert c.prefetch_policy is PrefetchPolicy.WAIT_COMPLETE and c.load_back_threshold_tokens == 0
    assert any("page_head" in a for a in c.adjustments)
    c = cli("--hicache-size", "2.5", "--hicache-mem-layout", "layer_first")
    assert c.hicache_size_gb == 2.5 and c.mem_layout is MemLayout.LAYER_FIRST


def test_cli_hierarchical_switches():
    assert not cli("--disable-hierarchical-cache").enable_hierarchical_cache
    assert cli("--enable-hierarchical-cache").enable_hierarchical_cache
    c = cli("--disable-hierarchical-cache", "--disable-radix-cache")
    assert c.disable_radix_cache and not c.enable_hierarchical_cache
    with pytest.raises(ConfigError, match="--disable-radix-cache"):
        cli("--disable-radix-cache")
    with pytest.raises(SystemExit):  # argparse: the two switches are mutually exclusive
        cli("--enable-hierarchical-cache", "--disable-hierarchical-cache")


@pytest.mark.parametrize("argv, words", [
    (["--hicache-write-policy", "sometimes"], ["--hicache-write-policy", "write_through"]),
    (["--hicache-mem-layout", "rows"], ["--hicache-mem-layout"]),
    (["--hicache-storage-backend", "hf3fs"], ["does not ship", "mooncake"]),
    (["--hicache-storage-backend", "aibrix"], ["does not ship"]),
    (["--hicache-storage-backend-extra-config", '{"root_dir": "/x"}'],
     ["--hicache-storage-backend"]),
    (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", "[1]"],
     ["JSON object"]),
    (["--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config", "{x"],
     ["not valid JSON"]),
    (["--hicache-host-mode", "storage_only"], ["--hicache-storage-backend"]),
])
def test_cli_errors(argv, words):
    with pytest.raises(ConfigError) as err:
        cli(*argv)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("suffix, text", [
    (".json", '{"fsync": true, "prefetch_threshold": 512}'),
    (".toml", "fsync = true\nprefetch_threshold = 512\n"),
    (".yaml", "fsync: true\nprefetch_threshold: 512\n"),
])
def test_extra_config_files(tmp_path, suffix, text):
    path = _write(tmp_path, "extra" + suffix, text)
    c = cli("--hicache-storage-backend", "file", "--hicache-storage-backend-extra-config",
            "@" + path)
    assert c.storage_options == FileOptions(fsync=True) and c.prefetch_threshold_tokens == 512


def test_sglang_extra_keys_are_lifted_and_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="kvtier.config")
    extra = json.dumps({"prefetch_threshold": 128, "prefetch_timeout_base": 1,
                        "prefetch_timeout_per_ki_token": 0.5, "prefetch_timeout_max": 9,
                        "protocol": "tcp"})
    argv = ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
            extra]
    c = cli(*argv)
    assert (c.prefetch_threshold_tokens, c.prefetch_timeout_base_s) == (128, 1.0)
    assert (c.prefetch_timeout_per_ki_token_s, c.prefetch_timeout_max_s) == (0.5, 9.0)
    assert c.storage_options == MooncakeOptions()
    assert sum("prefetch_timeout_max" in a for a in c.adjustments) == 1
    cli(*argv)
    lifted = [r for r in _adjust_records(caplog) if "prefetch_threshold=128" in r.getMessage()]
    assert len(lifted) == 1


def test_lifted_key_conflicting_with_config_file(tmp_path):
    path = _write(tmp_path, "c.yaml", "prefetch_threshold_tokens: 1024\n")
    base = ["--hicache-config", "@" + path, "--hicache-storage-backend", "file"]
    with pytest.raises(ConfigError) as err:
        cli(*base, "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 512}')
    msg = str(err.value)
    assert "prefetch_threshold=512" in msg and "--hicache-storage-backend-extra-config" in msg
    assert "prefetch_threshold_tokens=1024" in msg and path in msg
    c = cli(*base, "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 1024}')
    assert c.prefetch_threshold_tokens == 1024  # the same value twice is no conflict


def test_only_lifted_keys_without_backend_is_fine():
    c = cli("--hicache-storage-backend-extra-config", '{"prefetch_timeout_max": 10}')
    assert c.prefetch_timeout_max_s == 10.0 and c.storage_backend is None


def test_flag_backend_replacing_file_backend_needs_new_options(tmp_path):
    path = _write(tmp_path, "c.json", CONFIG_FILES["c.json"])
    with pytest.raises(ConfigError) as err:
        cli("--hicache-config", path, "--hicache-storage-backend", "nixl")
    assert "--hicache-storage-backend-extra-config" in str(err.value) and path in str(err.value)
    c = cli("--hicache-config", path, "--hicache-storage-backend", "nixl",
            "--hicache-storage-backend-extra-config", '{"plugin": "UCX"}')
    assert c.storage_options == NixlOptions(plugin=NixlPlugin.UCX)
    assert cli("--hicache-config", path, "--hicache-storage-backend", "file").storage_options \
        == FileOptions(root_dir="/data/l3")


# ---- fuzz --------------------------------------------------------------------------------

_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12)
    | st.sampled_from([m.value for e in (WritePolicy, IoBackend, MemLayout, HostMode,
                                         PrefetchPolicy, StorageBackendKind) for m in e]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                 max_size=3),
    max_leaves=6)
_keys = st.sampled_from(knob_names()) | st.text(max_size=10) | st.integers()
_option_keys = st.sampled_from(["root_dir", "max_size_bytes", "fsync", "master_address",
                                "protocol", "plugin", "bandwidth_gbps", "seed", "latency_s"])


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(_keys, _values, max_size=6))
def test_fuzz_from_dict_builds_or_raises_config_error(d):
    try:
        c = HiCacheConfig.from_dict(d)
    except ConfigError:
        return
    n = c.normalize()
    assert HiCacheConfig.from_dict(n.to_dict()) == n and n.normalize() == n
    assert isinstance(n.describe(), str)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(StorageBackendKind)), st.dictionaries(_option_keys, _values,
                                                                  max_size=4))
def test_fuzz_storage_options_builds_or_raises_config_error(kind, d):
    try:
        opts = parse_storage_options(kind, d)
    except ConfigError:
        return
    assert parse_storage_options(kind, opts.to_dict()) == opts
