"""The model and cache flags of `kvtier demo` (and of `kvtier bench instances`, which runs it):
`--model` and SGLang's `--hicache-*` flags / `--hicache-config`, checked against the demo.

The demo keeps its own L3 flags: `--hicache-storage-backend` must say what `--l3` says and the
extra config may only name `root_dir` (as `--l3-root`). `--page-size` must divide the demo's
prefill chunk. The demo shows L2 and L3 hits, so the flags that would turn L2 off, or make it
a mere staging area, are refused by name. Every other knob goes to every rank's cache config.
"""
from __future__ import annotations

import argparse
from typing import Any, NamedTuple

from kvtier.config import HiCacheConfig
from kvtier.errors import ConfigError
from kvtier.cli.flags import add_hicache_flags, config_from_args, l3_from_flags, refuse_tier_hiding
from kvtier.cli.shared_flags import SHARED_L3, add_l3_flag, add_model_flag
from kvtier.frontend.settings import L3_NONE
from kvtier.storage_options import EXTRA_CONFIG_FLAG

DEFAULT_MODEL = "smollm2"
L3_BACKENDS = tuple(k.value for k in SHARED_L3)
DEFAULT_L3 = "file"
DEFAULT_PAGE_SIZE = 64
# The demo's own choice where SGLang's default differs: B's L3 hit waits for its whole prefix.
CACHE_DEFAULTS = {"prefetch_policy": "wait_complete"}
# Knobs the demo sets from its own flags, not from the ranks' knobs.
OWNED = frozenset({"page_size", "storage_backend", "storage_options",
                   "enable_hierarchical_cache", "disable_radix_cache"})
# What --help says of the flags the demo owns or refuses.
HELP = {
    "--page-size": f"tokens per KV page, a power of two that divides the demo's 512-token "
                   f"prefill chunk (default {DEFAULT_PAGE_SIZE})",
    "--hicache-storage-backend": f"what --l3 says (default {DEFAULT_L3}); give one of them",
    EXTRA_CONFIG_FLAG: "only root_dir, as --l3-root (the L3 namespace actor configures the "
                       "backend itself)",
    "--disable-hierarchical-cache": "refused: the demo shows L2 and L3 hits",
    "--disable-radix-cache": "refused: the demo shows prefix hits",
    "--hicache-host-mode": "default cache (storage_only is refused: the demo shows an L2 hit)",
}


class DemoCache(NamedTuple):
    """The demo's cache settings from its flags (kvtier.cli.demo.DemoParams fields)."""

    l3: str
    l3_root: str
    page_size: int
    hicache: tuple[tuple[str, Any], ...]  # every other knob given: (name, plain value)


def add_arguments(p: argparse.ArgumentParser, allow_none: bool = False) -> None:
    """--l3, --model and SGLang's cache flags (`allow_none`: `--l3 none` too)."""
    add_l3_flag(p, None, allow_none=allow_none,
                note=", in a temp dir; SGLang's --hicache-storage-backend says the same")
    add_model_flag(p, DEFAULT_MODEL, note="; every node must be able to read it")
    add_hicache_flags(p, HiCacheConfig(page_size=DEFAULT_PAGE_SIZE, **CACHE_DEFAULTS), HELP)


def cache_from_args(ns: argparse.Namespace, l3_root: str = "") -> DemoCache:
    """The flags checked together (`ns.l3`: the command's --l3, None when not given)."""
    config = config_from_args(ns)  # validates the --hicache-* flags and the config file
    given = config.explicit or frozenset()
    refuse_tier_hiding(config, "kvtier demo")
    l3 = l3_from_flags(config, ns.l3, l3_root, "kvtier demo")
    if l3.backend is not None and l3.backend not in (*L3_BACKENDS, L3_NONE):
        raise ConfigError(f"--hicache-storage-backend {l3.backend}: kvtier demo's L3 is one "
                          f"of {', '.join(L3_BACKENDS)}")
    plain = config.to_dict()
    knobs = tuple(sorted((k, plain[k]) for k in given if k not in OWNED))
    return DemoCache(l3.backend or DEFAULT_L3, l3.root, plain["page_size"], knobs)


def cache_config(l3: str, page_size: int, hicache: tuple[tuple[str, Any], ...] = ()
                 ) -> HiCacheConfig:
    """Every rank's cache config: the demo's defaults and the knobs given, normalized as for
    an L3 of kind `l3` (the namespace attaches it, so the config itself names no backend)."""
    return HiCacheConfig.from_dict({**CACHE_DEFAULTS, **dict(hicache),
                                    "page_size": page_size}).normalize_for_l3(l3)
