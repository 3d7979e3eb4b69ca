"""The hierarchical-cache CLI flags (SGLang spellings) and the HiCacheConfig they build.

Precedence: kvtier defaults < `--hicache-config @file` < flags given on the command line.
Every flag defaults to None so that "not given" differs from "given the default value".
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

from kvtier.config import (FIELD_FLAGS, SGLANG_EXTRA_KEYS, HiCacheConfig, knob_names,
                           log_once)
from kvtier.errors import ConfigError
from kvtier.policies import (HostMode, IoBackend, MemLayout, PrefetchPolicy,
                             StorageBackendKind, WritePolicy)
from kvtier.storage_options import EXTRA_CONFIG_FLAG, check_keys

CONFIG_FLAG = "--hicache-config"
_SUFFIXES = (".json", ".toml", ".yaml", ".yml")


def _choices(enum_cls: type) -> str:
    return "{" + ",".join(m.value for m in enum_cls) + "}"


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def add_hicache_flags(parser: argparse.ArgumentParser, defaults: HiCacheConfig | None = None,
                      help_for: Mapping[str, str] | None = None) -> None:
    """Add the hierarchical-cache flags to `parser`. --help shows `defaults` (kvtier's when
    None: a command with defaults of its own passes them) and, for the flags `help_for`
    names, its text instead (what a command does with a flag it owns or refuses)."""
    d = defaults or HiCacheConfig()

    def text(flag: str, usual: str) -> str:
        return (help_for or {}).get(flag, usual)

    g = parser.add_argument_group("hierarchical KV cache")
    g.add_argument("--page-size", type=int, default=None, metavar="TOKENS",
                   help=text("--page-size",
                             f"tokens per KV page, a power of two (default {d.page_size})"))
    onoff = g.add_mutually_exclusive_group()
    onoff.add_argument("--enable-hierarchical-cache", dest="enable_hierarchical_cache",
                       action="store_const", const=True, default=None,
                       help=text("--enable-hierarchical-cache",
                                 "use the host (L2) and storage (L3) tiers (default on)"))
    onoff.add_argument("--disable-hierarchical-cache", dest="enable_hierarchical_cache",
                       action="store_const", const=False,
                       help=text("--disable-hierarchical-cache", "device (L1) cache only"))
    g.add_argument("--disable-radix-cache", action="store_const", const=True, default=None,
                   help=text("--disable-radix-cache",
                             "no prefix cache at all (needs --disable-hierarchical-cache)"))
    g.add_argument("--hicache-ratio", type=float, default=None, metavar="RATIO",
                   help=text("--hicache-ratio", f"host pool size / device pool size, > 1 "
                                                f"(default {d.hicache_ratio:g})"))
    g.add_argument("--hicache-size", type=float, default=None, metavar="GB",
                   help=text("--hicache-size", "host pool per rank in GB; overrides "
                                               "--hicache-ratio (default: unset)"))
    for flag, enum_cls, default in (
            ("--hicache-write-policy", WritePolicy, d.write_policy),
            ("--hicache-io-backend", IoBackend, d.io_backend),
            ("--hicache-mem-layout", MemLayout, d.mem_layout),
            ("--hicache-storage-prefetch-policy", PrefetchPolicy, d.prefetch_policy),
            ("--hicache-host-mode", HostMode, d.host_mode)):
        # Validated by HiCacheConfig (not argparse choices) so a bad value is a ConfigError
        # with the same message whether it came from a flag or a config file.
        g.add_argument(flag, default=None, metavar=_choices(enum_cls),
                       help=text(flag, f"default {default.value}"))
    g.add_argument("--hicache-storage-backend", default=None,
                   metavar=_choices(StorageBackendKind),
                   help=text("--hicache-storage-backend", "L3 backend (default: none)"))
    g.add_argument(EXTRA_CONFIG_FLAG, default=None, metavar="JSON|@FILE",
                   help=text(EXTRA_CONFIG_FLAG, "backend options as a JSON object, or @path "
                                                "to a .json/.toml/.yaml file"))
    g.add_argument("--hicache-load-back-threshold", type=int, default=None, metavar="TOKENS",
                   help=text("--hicache-load-back-threshold",
                             f"shortest host hit (tokens) worth loading back "
                             f"(default {d.load_back_threshold_tokens})"))
    g.add_argument(CONFIG_FLAG, default=None, metavar="@FILE",
                   help=text(CONFIG_FLAG, "a whole hicache config (.json/.toml/.yaml); flags "
                                          "given override it"))


def config_from_args(ns: argparse.Namespace) -> HiCacheConfig:
    """The normalized HiCacheConfig from parsed flags (and the --hicache-config file)."""
    merged: dict[str, Any] = {}
    source: dict[str, str] = {}  # field -> where its value came from, for conflict messages
    config_path = getattr(ns, "hicache_config", None)
    if config_path is not None:
        path = config_path[1:] if config_path.startswith("@") else config_path
        merged = check_keys(load_mapping_file(path, CONFIG_FLAG), knob_names(),
                            f"{CONFIG_FLAG} {path}")
        source = {name: f"{CONFIG_FLAG} {path}" for name in merged}
    file_backend = merged.get("storage_backend")
    for name, flag in FIELD_FLAGS.items():
        value = getattr(ns, _dest(flag), None)
        if value is not None and name != "storage_options":
            merged[name], source[name] = value, flag
    notes: list[str] = []
    extra = getattr(ns, _dest(EXTRA_CONFIG_FLAG), None)
    if extra is not None:
        options = parse_extra_config(extra)
        notes = _lift_sglang_keys(options, merged, source)
        merged["storage_options"] = options
    elif merged.get("storage_options") and source.get("storage_backend") == FIELD_FLAGS[
            "storage_backend"]:
        _check_same_backend(file_backend, merged["storage_backend"], source)
    config = HiCacheConfig.from_dict(merged).normalize()
    return dataclasses.replace(config, adjustments=tuple(notes) + config.adjustments)


class L3Choice(NamedTuple):
    """The L3 a command's own --l3 / --l3-root and SGLang's flags agree on."""

    backend: str | None  # None: neither --l3 nor --hicache-storage-backend was given
    root: str  # "": neither --l3-root nor the extra config's root_dir was given


# knob -> (the value that turns L2 off, the prefix cache off, or L2 into L3's staging area;
# the flag that gives it): commands that show or measure hits in every tier refuse these
TIER_HIDING: dict[str, tuple[Any, str]] = {
    "enable_hierarchical_cache": (False, "--disable-hierarchical-cache"),
    "disable_radix_cache": (True, "--disable-radix-cache"),
    "host_mode": (HostMode.STORAGE_ONLY, "--hicache-host-mode storage_only"),
}


def refuse_tier_hiding(config: HiCacheConfig, command: str) -> None:
    """A ConfigError naming the flag when `config` (config_from_args') was given a value of
    TIER_HIDING: `command` shows or measures hits from L1, L2 and L3."""
    given = config.explicit or frozenset()
    for name, (value, flag) in TIER_HIDING.items():
        if name in given and getattr(config, name) == value:
            raise ConfigError(f"{flag}: {command} shows hits from L1, L2 and L3, which this "
                              f"would leave out; drop the flag")


def l3_from_flags(config: HiCacheConfig, l3: str | None, l3_root: str,
                  command: str) -> L3Choice:
    """For commands whose L3 namespace actor configures the backend: --hicache-storage-backend
    must say what --l3 says, and the extra config may only name root_dir, which must say what
    --l3-root says. `config` is config_from_args' (its `explicit` tells what was given)."""
    given = config.explicit or frozenset()
    backend = config.storage_backend.value if "storage_backend" in given else None
    if l3 is not None and backend is not None and l3 != backend:
        raise ConfigError(f"--l3 {l3} and --hicache-storage-backend {backend} disagree; "
                          f"give one of them")
    options = config.storage_options if "storage_options" in given else None
    if options is None:
        return L3Choice(l3 or backend, l3_root)
    defaults = type(options)().to_dict()  # what the user changed: options[k] != default
    extra = sorted(k for k, v in options.to_dict().items()
                   if k != "root_dir" and v != defaults.get(k))
    if extra:
        raise ConfigError(f"{EXTRA_CONFIG_FLAG}: {command} takes only root_dir there (the L3 "
                          f"namespace actor configures the backend itself); remove "
                          f"{', '.join(extra)}")
    root = getattr(options, "root_dir", None)
    if l3_root and root not in (None, l3_root):
        raise ConfigError("--l3-root and the extra config's root_dir disagree; give one")
    return L3Choice(l3 or backend, root or l3_root)


def parse_extra_config(value: str) -> dict[str, Any]:
    """--hicache-storage-backend-extra-config: a JSON object string, or @path to a file."""
    if value.startswith("@"):
        return load_mapping_file(value[1:], EXTRA_CONFIG_FLAG)
    try:
        data = json.loads(value)
    except ValueError as exc:
        raise ConfigError(f"{EXTRA_CONFIG_FLAG}: not valid JSON ({exc}); pass a JSON object "
                          "such as '{\"root_dir\": \"/data/kv\"}', or @path to a file") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{EXTRA_CONFIG_FLAG}: expected a JSON object, got {type(data).__name__}")
    return data


def load_mapping_file(path: str, flag: str) -> dict[str, Any]:
    """The top-level object of a .json, .toml, .yaml or .yml file."""
    path = os.path.expanduser(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in _SUFFIXES:
        raise ConfigError(f"{flag} {path}: unsupported file type {suffix or '(none)'!r}; "
                          f"use one of {', '.join(_SUFFIXES)}")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"{flag} {path}: file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{flag} {path}: cannot read it ({exc})") from None
    data = _parse_text(text, suffix, path, flag)
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} {path}: the file must hold an object (key: value mapping) "
                          f"at the top level, got {type(data).__name__}")
    return data


def _parse_text(text: str, suffix: str, path: str, flag: str) -> Any:
    if suffix == ".json":
        loads, errors = json.loads, (ValueError, RecursionError)
    elif suffix == ".toml":
        tomllib = _import_tomllib(path, flag)
        loads, errors = tomllib.loads, (tomllib.TOMLDecodeError,)
    else:
        import yaml  # imported lazily: only YAML configs need it

        loads, errors = yaml.safe_load, (yaml.YAMLError, RecursionError)
    try:
        return loads(text)
    except errors as exc:
        raise ConfigError(f"{flag} {path}: invalid {suffix[1:].upper()} ({exc})") from None


def _import_tomllib(path: str, flag: str) -> Any:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise ConfigError(f"{flag} {path}: reading TOML needs Python >= 3.11 or the "
                              "tomli package; or use a .json/.yaml file") from None
    return tomllib


def _lift_sglang_keys(options: dict[str, Any], merged: dict[str, Any],
                      source: dict[str, str]) -> list[str]:
    """Move SGLang's prefetch keys out of the extra config into top-level fields."""
    notes = []
    for key, name in SGLANG_EXTRA_KEYS.items():
        if key not in options:
            continue
        value = options.pop(key)
        if name in merged and merged[name] != value:
            raise ConfigError(f"{key}={value!r} in {EXTRA_CONFIG_FLAG} conflicts with "
                              f"{name}={merged[name]!r} from {source[name]}: set it in one place")
        merged[name], source[name] = value, EXTRA_CONFIG_FLAG
        notes.append(f"{key}={value!r} from {EXTRA_CONFIG_FLAG} used as {name}")
    for note in notes:
        log_once(f"hicache config adjusted: {note}")
    return notes


def _check_same_backend(file_backend: Any, backend: Any, source: dict[str, str]) -> None:
    """storage_options from the config file must belong to the backend the flags chose."""
    if str(file_backend).lower() != str(backend).lower():
        raise ConfigError(f"--hicache-storage-backend {backend} replaces {file_backend!r} from "
                          f"{source['storage_options']}, whose storage_options are for "
                          f"{file_backend!r}: give {EXTRA_CONFIG_FLAG} for {backend} or edit the file")
