"""HiCacheConfig: the one validated, normalized settings tree of the hierarchical cache.

Construction validates types, ranges and conflicts (errors name the CLI flag and the fix);
`normalize()` applies the reference's automatic adjustments, each logged once per process.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from kvtier.errors import ConfigError
from kvtier.policies import (HostMode, IoBackend, MemLayout, PrefetchPolicy,
                             StorageBackendKind, WritePolicy, _Choice)
from kvtier.storage_options import (EXTRA_CONFIG_FLAG, StorageOptions, check_bool,
                                    check_float, check_int, check_keys, parse_storage_options)

_LOG = logging.getLogger("kvtier.config")
_LOGGED: set[str] = set()
_LOGGED_LOCK = threading.Lock()

MAX_TOKENS = (1 << 31) - 1
MAX_PAGE_SIZE = 4096
GB = 10**9  # the reference's --hicache-size unit (decimal gigabytes per rank)

# Field -> CLI flag, so every error names what the user typed. Fields without a flag are set
# in a --hicache-config file (or, for SGLang compatibility, in the extra config).
FIELD_FLAGS: Mapping[str, str] = {
    "page_size": "--page-size",
    "enable_hierarchical_cache": "--enable-hierarchical-cache",
    "disable_radix_cache": "--disable-radix-cache",
    "hicache_ratio": "--hicache-ratio",
    "hicache_size_gb": "--hicache-size",
    "write_policy": "--hicache-write-policy",
    "io_backend": "--hicache-io-backend",
    "mem_layout": "--hicache-mem-layout",
    "host_mode": "--hicache-host-mode",
    "prefetch_policy": "--hicache-storage-prefetch-policy",
    "load_back_threshold_tokens": "--hicache-load-back-threshold",
    "storage_backend": "--hicache-storage-backend",
    "storage_options": EXTRA_CONFIG_FLAG,
}
# Fields vLLM's KvtierConnector takes (connector/settings.py); the others are kvtier's engine's
# (vLLM owns L1). Its kv_connector_extra_config names each as `connector_key` says.
CONNECTOR_FIELDS = ("hicache_ratio", "hicache_size_gb", "write_policy", "prefetch_policy",
                    "storage_backend", "storage_options")


# the kv_connector_extra_config key that turns peer-to-peer L2 on: "nixl" or "mooncake"
CONNECTOR_PEER_KEY = "peer_transport"


def connector_key(field: str) -> str:
    """The kv_connector_extra_config key of field `field`: its flag, as a key
    (`--hicache-storage-backend` -> `hicache_storage_backend`)."""
    return FIELD_FLAGS[field].lstrip("-").replace("-", "_")


# Keys SGLang reads from its extra config, lifted into top-level fields (see kvtier.cli.flags).
SGLANG_EXTRA_KEYS: Mapping[str, str] = {
    "prefetch_threshold": "prefetch_threshold_tokens",
    "prefetch_timeout_base": "prefetch_timeout_base_s",
    "prefetch_timeout_per_ki_token": "prefetch_timeout_per_ki_token_s",
    "prefetch_timeout_max": "prefetch_timeout_max_s",
}
# SGLang storage backends kvtier does not ship: a clear "not supported" beats "not a choice".
SGLANG_ONLY_BACKENDS = frozenset({"hf3fs", "aibrix", "eic", "dynamic", "lmcache"})

_INT_RANGES = {"page_size": (1, MAX_PAGE_SIZE), "prefetch_threshold_tokens": (0, MAX_TOKENS),
               "load_back_threshold_tokens": (0, MAX_TOKENS), "storage_batch_pages": (1, 1 << 20)}
_FLOAT_RANGES = {"hicache_ratio": (0.0, 1e4), "hicache_size_gb": (0.0, 1e6),
                 "prefetch_timeout_base_s": (0.0, 86400.0),
                 "prefetch_timeout_per_ki_token_s": (0.0, 86400.0),
                 "prefetch_timeout_max_s": (0.0, 86400.0),
                 "prefetch_capacity_ratio": (0.0, 1.0)}
_ENUMS = {"write_policy": WritePolicy, "io_backend": IoBackend, "mem_layout": MemLayout,
          "host_mode": HostMode, "prefetch_policy": PrefetchPolicy}


def where(name: str) -> str:
    """How a user sets field `name`: its CLI flag, else its --hicache-config key."""
    if name in FIELD_FLAGS:
        return f"{FIELD_FLAGS[name]} ({name})"
    alias = next((k for k, v in SGLANG_EXTRA_KEYS.items() if v == name), None)
    extra = f" or {alias!r} in {EXTRA_CONFIG_FLAG}" if alias else ""
    return f"--hicache-config key {name!r}{extra}"


def log_once(message: str) -> None:
    """Log an automatic adjustment at INFO the first time this process sees it."""
    with _LOGGED_LOCK:
        if message in _LOGGED:
            return
        _LOGGED.add(message)
    _LOG.info(message)


def _reset_logged_for_tests() -> None:
    with _LOGGED_LOCK:
        _LOGGED.clear()


def _parse_backend(value: Any) -> StorageBackendKind | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in SGLANG_ONLY_BACKENDS:
        supported = ", ".join(k.value for k in StorageBackendKind)
        raise ConfigError(f"{where('storage_backend')}: {value!r} is an SGLang backend kvtier "
                          f"does not ship; use one of: {supported}")
    return StorageBackendKind.parse(value, where("storage_backend"))


@dataclass(frozen=True, slots=True)
class HiCacheConfig:
    """Every knob of the hierarchical cache, with units in the names."""

    page_size: int = 64
    enable_hierarchical_cache: bool = True
    disable_radix_cache: bool = False
    hicache_ratio: float = 2.0  # host pool / device pool; ignored when hicache_size_gb > 0
    hicache_size_gb: float = 0.0  # host pool per rank in GB; 0 = use hicache_ratio
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    io_backend: IoBackend = IoBackend.KERNEL
    mem_layout: MemLayout = MemLayout.PAGE_FIRST
    host_mode: HostMode = HostMode.CACHE
    prefetch_policy: PrefetchPolicy = PrefetchPolicy.TIMEOUT
    prefetch_threshold_tokens: int = 256
    prefetch_timeout_base_s: float = 2.0
    prefetch_timeout_per_ki_token_s: float = 0.1
    prefetch_timeout_max_s: float = 30.0
    load_back_threshold_tokens: int = 10
    prefetch_capacity_ratio: float = 0.5  # share of the host pool in-flight prefetches may hold
    storage_batch_pages: int = 128
    storage_backend: StorageBackendKind | None = None
    storage_options: StorageOptions | None = None  # defaults filled in when a backend is set
    # What the normalize() that produced this config changed; not a knob, not compared.
    adjustments: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # The knobs the user set: `from_dict` (and so the CLI flags and --hicache-config) records
    # the keys it was given; None when built directly in Python (see `is_explicit`). Lets
    # automatic tuning (kvtier.calibration) leave the user's choices alone. Not compared.
    explicit: frozenset[str] | None = field(default=None, compare=False, repr=False)

    # ---- construction ---------------------------------------------------------------------

    def __post_init__(self) -> None:
        for name, (lo, hi) in _INT_RANGES.items():
            check_int(getattr(self, name), where(name), lo, hi)
        for name, (lo, hi) in _FLOAT_RANGES.items():
            self._set(name, check_float(getattr(self, name), where(name), lo, hi))
        for name in ("enable_hierarchical_cache", "disable_radix_cache"):
            check_bool(getattr(self, name), where(name))
        for name, enum_cls in _ENUMS.items():
            value = getattr(self, name)
            if not isinstance(value, (str, enum_cls)):  # parse() would reject it too, less clearly
                raise ConfigError(f"{where(name)}: expected a string, got {value!r}")
            self._set(name, enum_cls.parse(value, where(name)))
        self._set("storage_backend", _parse_backend(self.storage_backend))
        self._set("storage_options", self._checked_options())
        self._set("adjustments", tuple(str(a) for a in self.adjustments))
        if self.explicit is not None:
            self._set("explicit", frozenset(check_keys(dict.fromkeys(self.explicit),
                                                       knob_names(), "explicit")))
        self._check_conflicts()

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: coerce types once, at construction

    def _checked_options(self) -> StorageOptions | None:
        options = self.storage_options
        if self.storage_backend is not None:
            return parse_storage_options(self.storage_backend, options)
        if options is None or (isinstance(options, Mapping) and not options):
            return None
        raise ConfigError(f"{EXTRA_CONFIG_FLAG} (storage_options) was given without "
                          f"{FIELD_FLAGS['storage_backend']}: name the backend it is for "
                          f"({', '.join(k.value for k in StorageBackendKind)}) or drop the options")

    def _check_conflicts(self) -> None:
        if self.page_size & (self.page_size - 1):
            raise ConfigError(f"{where('page_size')}: {self.page_size} is not a power of two; "
                              f"use 1, 2, 4, ..., {MAX_PAGE_SIZE}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ConfigError("--enable-hierarchical-cache needs the radix cache: drop "
                              "--disable-radix-cache, or pass --disable-hierarchical-cache")
        if self.storage_backend is not None and not self.enable_hierarchical_cache:
            raise ConfigError("--hicache-storage-backend needs the hierarchical cache: drop "
                              "--disable-hierarchical-cache, or drop the storage backend")
        if self.host_mode is HostMode.STORAGE_ONLY:
            if self.storage_backend is None:
                raise ConfigError("--hicache-host-mode storage_only needs "
                                  "--hicache-storage-backend; set one or use --hicache-host-mode cache")
            if self.write_policy is WritePolicy.WRITE_BACK:
                raise ConfigError("--hicache-host-mode storage_only cannot use "
                                  "--hicache-write-policy write_back (pages would never reach "
                                  "storage); use write_through or write_through_selective")
        if self.hicache_size_gb == 0.0 and self.hicache_ratio <= 1.0:
            raise ConfigError(f"{where('hicache_ratio')} is {self.hicache_ratio} but the host pool "
                              "must be larger than the device pool: set it above 1.0 "
                              "(default 2.0), or give --hicache-size in GB")
        if self.prefetch_timeout_max_s < self.prefetch_timeout_base_s:
            raise ConfigError(f"{where('prefetch_timeout_max_s')} ({self.prefetch_timeout_max_s}) "
                              f"is below {where('prefetch_timeout_base_s')} "
                              f"({self.prefetch_timeout_base_s}): raise the max or lower the base")
        if self.prefetch_capacity_ratio <= 0.0:
            raise ConfigError(f"{where('prefetch_capacity_ratio')} must be in (0, 1], got "
                              f"{self.prefetch_capacity_ratio}; the default is 0.5")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "HiCacheConfig":
        """Build from plain data (a parsed JSON/TOML/YAML object); enums may be strings."""
        fields = check_keys(d, knob_names(), "hicache config")
        return cls(**fields, explicit=frozenset(fields))

    @classmethod
    def normalized(cls, **fields: Any) -> "HiCacheConfig":
        """Construct and normalize in one step."""
        return cls(**fields).normalize()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data; `from_dict(to_dict())` gives an equal config."""
        out: dict[str, Any] = {}
        for name in knob_names():
            value = getattr(self, name)
            if isinstance(value, _Choice):
                value = value.value
            elif name == "storage_options" and value is not None:
                value = value.to_dict()
            out[name] = value
        return out

    # ---- normalization --------------------------------------------------------------------

    def normalize(self) -> "HiCacheConfig":
        """A copy with the reference's adjustments applied, each logged once per process.

        Idempotent: normalizing the result changes nothing (and records no adjustments).
        """
        changes, notes = self._adjusted()
        for note in notes:
            log_once(f"hicache config adjusted: {note}")
        return dataclasses.replace(self, **changes, adjustments=tuple(notes))

    def normalize_for_l3(self, backend: Any) -> "HiCacheConfig":
        """`normalize()` as if L3 of kind `backend` (None: none) were configured, for a cache
        whose L3 is attached later (through the namespace actor): the result names no
        backend itself, but has the adjustments a configured one brings (any layout ->
        page_head)."""
        if backend is None:
            return self.normalize()
        with_l3 = HiCacheConfig.from_dict({**self.to_dict(), "storage_backend": backend,
                                           "storage_options": None})
        return dataclasses.replace(with_l3.normalize(), storage_backend=None,
                                   storage_options=None)

    def _adjusted(self) -> tuple[dict[str, Any], list[str]]:
        """The field changes normalization makes and a sentence for each; pure."""
        changes: dict[str, Any] = {}
        notes: list[str] = []
        layout, io = self.mem_layout, self.io_backend
        if self.storage_backend is not None and layout.with_l3() is not layout:
            # MemLayout.with_l3: the L2<->L1 copy does the transpose.
            layout = changes["mem_layout"] = layout.with_l3()
            notes.append(f"--hicache-mem-layout {self.mem_layout} -> page_head: the "
                         f"{self.storage_backend} backend stores each KV head of a page part "
                         "as one contiguous object")
        if layout is MemLayout.PAGE_FIRST and io is IoBackend.DIRECT:
            layout = changes["mem_layout"] = MemLayout.PAGE_FIRST_DIRECT
            notes.append("--hicache-mem-layout page_first -> page_first_direct: "
                         "--hicache-io-backend direct copies whole pages")
        if layout is MemLayout.PAGE_FIRST_DIRECT and io is IoBackend.KERNEL:
            changes["io_backend"] = IoBackend.DIRECT
            notes.append("--hicache-io-backend kernel -> direct: the page_first_direct layout "
                         "is copied page by page")
        if self.prefetch_threshold_tokens < self.page_size:
            changes["prefetch_threshold_tokens"] = self.page_size
            notes.append(f"prefetch_threshold_tokens {self.prefetch_threshold_tokens} -> "
                         f"{self.page_size}: a prefetch is never shorter than one page")
        if self.hicache_size_gb > 0.0 and self.hicache_ratio != 0.0:
            changes["hicache_ratio"] = 0.0  # 0.0 marks "unused": the size decides
            notes.append(f"--hicache-size {self.hicache_size_gb:g} GB overrides "
                         f"--hicache-ratio {self.hicache_ratio:g}")
        return changes, notes

    # ---- derived values -------------------------------------------------------------------

    def is_explicit(self, name: str) -> bool:
        """Whether the user set knob `name`: listed in `explicit`, or, when that is unknown
        (None), a value other than the field's default."""
        if self.explicit is not None:
            return name in self.explicit
        return getattr(self, name) != _FIELD_DEFAULTS[name]

    @property
    def write_through_hit_threshold(self) -> int | None:
        """Hits before an L1 page is backed up to L2; None for write_back (eviction only)."""
        return {WritePolicy.WRITE_THROUGH: 1,
                WritePolicy.WRITE_THROUGH_SELECTIVE: 2}.get(self.write_policy)

    def prefetch_timeout_s(self, num_tokens: int) -> float:
        """Longest wait for an L3 prefetch of `num_tokens`: base + per-Ki-token, capped."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        scaled = self.prefetch_timeout_base_s + self.prefetch_timeout_per_ki_token_s * num_tokens / 1024
        return min(self.prefetch_timeout_max_s, scaled)

    def host_pool_bytes(self, device_pool_bytes: int) -> int:
        """L2 capacity per rank: --hicache-size when given, else ratio x the L1 pool."""
        if self.hicache_size_gb > 0.0:
            return int(self.hicache_size_gb * GB)
        return int(device_pool_bytes * self.hicache_ratio)

    def describe(self) -> str:
        """One line with the effective (normalized) settings, for startup logs."""
        cfg = dataclasses.replace(self, **self._adjusted()[0])
        if not cfg.enable_hierarchical_cache:
            return f"hicache off (page_size={cfg.page_size}, radix={not cfg.disable_radix_cache})"
        host = (f"{cfg.hicache_size_gb:g}GB/rank" if cfg.hicache_size_gb > 0
                else f"{cfg.hicache_ratio:g}x device")
        parts = [f"page_size={cfg.page_size}", f"host={host}", f"host_mode={cfg.host_mode}",
                 f"write={cfg.write_policy}", f"io={cfg.io_backend}", f"layout={cfg.mem_layout}",
                 f"load_back>={cfg.load_back_threshold_tokens}tok"]
        if cfg.storage_backend is not None:
            opts = ",".join(f"{k}={v}" for k, v in cfg.storage_options.to_dict().items())
            parts += [f"storage={cfg.storage_backend}({opts})",
                      f"prefetch={cfg.prefetch_policy}(>={cfg.prefetch_threshold_tokens}tok, "
                      f"timeout=min({cfg.prefetch_timeout_max_s:g}s, "
                      f"{cfg.prefetch_timeout_base_s:g}s+{cfg.prefetch_timeout_per_ki_token_s:g}s/Ki)"
                      f", capacity={cfg.prefetch_capacity_ratio:g})",
                      f"batch={cfg.storage_batch_pages}pages"]
        return "hicache " + " ".join(parts)

    def __str__(self) -> str:
        return self.describe()


def knob_names() -> list[str]:
    """Names of the settable fields, in declaration order (all but `adjustments`, `explicit`)."""
    return [f.name for f in dataclasses.fields(HiCacheConfig)
            if f.name not in ("adjustments", "explicit")]


_FIELD_DEFAULTS: Mapping[str, Any] = {f.name: f.default for f in dataclasses.fields(HiCacheConfig)}


class HiCacheConfigRecord(NamedTuple):
    """A HiCacheConfig as it crosses to another process (kvtier.messages `pack_record`): its
    validated dict by SGLang's knob names, as a --hicache-config file spells it, which
    `config()` builds again, so the receiver runs every check and cross-check once more.
    HiCacheConfig is no record itself: its storage options are one of several option
    types, and its construction (normalized values, conflicts) is the check that counts."""

    knobs: dict[str, Any]  # to_dict() without storage_options: plain values
    storage_options: dict[str, Any] | None = None  # the backend's options, plain values
    explicit: tuple[str, ...] | None = None  # the knobs the user set (HiCacheConfig.explicit)

    @classmethod
    def of(cls, config: HiCacheConfig) -> "HiCacheConfigRecord":
        knobs = config.to_dict()
        options = knobs.pop("storage_options")
        explicit = None if config.explicit is None else tuple(sorted(config.explicit))
        return cls(knobs, options, explicit)

    def config(self) -> HiCacheConfig:
        """The config again, checked (a ConfigError names a knob that is not one)."""
        knobs = check_keys(self.knobs, knob_names(), "hicache config")
        return HiCacheConfig(**{**knobs, "storage_options": self.storage_options},
                             explicit=None if self.explicit is None else frozenset(self.explicit))
