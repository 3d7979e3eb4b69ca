"""Validated, frozen options for each L3 storage backend, and the value checks config shares.

Why typed options instead of the reference's free-form `extra_config` dict: a typo in a key
or a wrong unit must fail at startup with the valid choices, not be ignored at runtime.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import ipaddress
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.errors import ConfigError
from kvtier.policies import StorageBackendKind, _Choice

MiB = 1 << 20
PiB = 1 << 50
MAX_BYTES = PiB  # larger sizes are typos (a unit mix-up), never a real deployment
_MAX_PATH_CHARS = 4096
_MAX_HOST_CHARS = 255
EXTRA_CONFIG_FLAG = "--hicache-storage-backend-extra-config"
AUTO_HOST = "auto"  # MooncakeOptions.master_host: the cluster decides (see there)
AUTO_REPLICAS = "auto"  # MooncakeOptions.replica_num: the cluster's host count decides
MAX_REPLICAS = 16  # copies of an object in Mooncake; more is a typo, not a deployment


# ---- value checks shared with kvtier.config ---------------------------------------------

def check_int(value: Any, where: str, lo: int, hi: int) -> int:
    """An int (never a bool: True is an int in Python) in [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise ConfigError(f"{where}: must be between {lo} and {hi}, got {value}")
    return value


def check_float(value: Any, where: str, lo: float, hi: float) -> float:
    """A finite number in [lo, hi], returned as float (ints are accepted)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    try:
        number = float(value)
    except OverflowError:  # a huge int cannot become a float
        raise ConfigError(f"{where}: must be between {lo} and {hi}, got {value}") from None
    if not math.isfinite(number) or not lo <= number <= hi:
        raise ConfigError(f"{where}: must be a finite number between {lo} and {hi}, got {value}")
    return number


def check_bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def check_str(value: Any, where: str, max_chars: int, *, allow_slash: bool = True,
              allow_empty: bool = False) -> str:
    """A short printable string without whitespace or NUL (paths, hosts, device names)."""
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if not value and not allow_empty:
        raise ConfigError(f"{where}: must not be empty")
    if len(value) > max_chars:
        raise ConfigError(f"{where}: longer than {max_chars} characters")
    if "\x00" in value or any(ch.isspace() or not ch.isprintable() for ch in value):
        raise ConfigError(f"{where}: {value!r} must not contain whitespace or control characters")
    if not allow_slash and "/" in value:
        raise ConfigError(f"{where}: {value!r} must be a host or address, without '/'")
    return value


def check_ipv4(value: Any, where: str) -> str:
    """A dotted IPv4 address a server may bind: not 0.0.0.0 (every interface), not multicast."""
    text = check_str(value, where, _MAX_HOST_CHARS, allow_slash=False)
    try:
        ip = ipaddress.IPv4Address(text)
    except ValueError:
        raise ConfigError(f"{where}: {text!r} is not an IPv4 address (like 10.0.0.5)") from None
    if ip.is_unspecified or ip.is_multicast or ip == ipaddress.IPv4Address("255.255.255.255"):
        raise ConfigError(f"{where}: {text} is not the address of one interface; give an "
                          f"address of this node, or {AUTO_HOST!r}")
    return text


def check_abs_path(value: Any, where: str) -> str:
    """An absolute directory path (relative ones would depend on each actor's cwd)."""
    path = check_str(value, where, _MAX_PATH_CHARS)
    if not os.path.isabs(path):
        raise ConfigError(f"{where}: {path!r} must be an absolute path (start with '/')")
    return path


def check_keys(d: Any, valid: list[str], where: str) -> dict[str, Any]:
    """A mapping with string keys, all of them in `valid`; returned as a plain dict."""
    if not isinstance(d, Mapping):
        raise ConfigError(f"{where}: expected a mapping (JSON object), got {type(d).__name__}")
    for key in d:
        if not isinstance(key, str):
            raise ConfigError(f"{where}: keys must be strings, got {key!r}")
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"{where}: unknown key {key!r}{hint}; valid keys: {', '.join(valid)}")
    return dict(d)


# ---- backend option enums ---------------------------------------------------------------

class MooncakeProtocol(_Choice):
    """Transport of the Mooncake transfer engine."""

    TCP = "tcp"
    RDMA = "rdma"


class NixlPlugin(_Choice):
    """NIXL backend plugin; values are NIXL's own (upper-case) names."""

    POSIX = "POSIX"  # memory <-> local files
    UCX = "UCX"  # memory <-> remote host memory

    @classmethod
    def _missing_(cls, value: object) -> "NixlPlugin | None":
        # _Choice.parse lower-cases its input; NIXL names are upper-case.
        if isinstance(value, str):
            return next((m for m in cls if m.value == value.upper()), None)
        return None


# ---- per-backend options ----------------------------------------------------------------

class _Options:
    """Shared from_dict/to_dict of the frozen option dataclasses below."""

    __slots__ = ()
    kind: ClassVar[StorageBackendKind]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "_Options":
        valid = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        # `d or {}` would take 0, False or "" for "no options": only None means the defaults
        return cls(**check_keys({} if d is None else d, valid, cls._where()))

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}  # type: ignore[arg-type]
        return {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in out.items()}

    @classmethod
    def _where(cls, key: str | None = None) -> str:
        base = f"{EXTRA_CONFIG_FLAG} (storage_options of the {cls.kind.value} backend)"
        return f"{base} key {key!r}" if key else base

    def _set(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalize types once, at construction


@dataclass(frozen=True, slots=True)
class FileOptions(_Options):
    """Embedded file backend: one file per page object under `root_dir`."""

    kind: ClassVar[StorageBackendKind] = StorageBackendKind.FILE
    root_dir: str = "/tmp/kvtier-l3"
    max_size_bytes: int = 0  # 0 = unbounded
    fsync: bool = False
    # Readers compare each payload's xxh3 with the one in its header (writers always store
    # it: the format is the same either way). Off trades safety for CPU: a flipped payload
    # bit reads as wrong KV instead of a miss (the header is still checked, so a foreign,
    # torn or truncated file stays a miss), and reads skip the xxh3 pass over every byte,
    # which the I/O threads partly hide (docs/benchmarks.md has the figures). Turn it off
    # only on trusted storage.
    verify_checksums: bool = True
    # For fault drills (`kvtier bench chaos`), never in production: a JSON file of fault rules
    # (backends/faulty.py) that every rank's client follows while it exists ("" = none).
    fault_file: str = ""

    def __post_init__(self) -> None:
        check_abs_path(self.root_dir, self._where("root_dir"))
        check_int(self.max_size_bytes, self._where("max_size_bytes"), 0, MAX_BYTES)
        check_bool(self.fsync, self._where("fsync"))
        check_bool(self.verify_checksums, self._where("verify_checksums"))
        if self.fault_file:
            check_abs_path(self.fault_file, self._where("fault_file"))


@dataclass(frozen=True, slots=True)
class MooncakeOptions(_Options):
    """Mooncake Store client (and, when `master_address` is None, the master kvtier starts)."""

    kind: ClassVar[StorageBackendKind] = StorageBackendKind.MOONCAKE
    master_address: str | None = None  # None: kvtier starts its own master (on master_host)
    # Where a master kvtier starts binds (its RPC and metrics ports): an IPv4 address of the
    # node it runs on, or "auto": the namespace actor's node address when the Ray cluster has
    # more than one alive node at registration, 127.0.0.1 otherwise (and for a backend opened
    # on its own, outside a namespace).
    master_host: str = AUTO_HOST
    metadata_server: str | None = None  # a URL (http://host:port/metadata) or P2PHANDSHAKE
    protocol: MooncakeProtocol = MooncakeProtocol.TCP
    device_name: str = ""
    # The address this client's transfer engine registers. None: 127.0.0.1, or under a
    # namespace whose master is not on loopback, the rank's own node address.
    local_hostname: str | None = None
    global_segment_size_bytes: int = 256 * MiB
    local_buffer_size_bytes: int = 64 * MiB
    # xxh3 of every page part as an 8-byte trailer of its object, verified after each read
    # (sizes are checked always). On by default: a corrupt page must be a miss, never wrong
    # KV. Every backend of a namespace must agree (objects differ by the trailer); the cost
    # is in docs/benchmarks.md. Turn it off only where the store is trusted.
    verify_checksums: bool = True
    start_timeout_s: float = 15.0  # bound on starting the master and connecting to it
    # Bound on each Mooncake Store call (exists, get, put, remove): past it a read is a miss
    # and a write a failure, whatever Mooncake does (a peer whose link is cut can hold a
    # call for minutes; backends/mooncake_backend.py says how the pages stay safe).
    call_timeout_s: float = 5.0
    # Copies of each object, on different segments (clients): 2+ keeps a page readable when
    # one host's segment is gone. "auto": 1 for a backend opened on its own; under an L3
    # namespace, 2 when the Ray cluster's alive nodes are on 2+ hosts at registration
    # (actors/l3/hosts.py), 1 otherwise.
    replica_num: int | str = AUTO_REPLICAS

    def __post_init__(self) -> None:
        if self.master_address is not None:
            check_str(self.master_address, self._where("master_address"), _MAX_HOST_CHARS,
                      allow_slash=False)
        if self.metadata_server is not None:  # a URL: slashes allowed, whitespace not
            check_str(self.metadata_server, self._where("metadata_server"), 1024)
        self._set("protocol", MooncakeProtocol.parse(self.protocol, self._where("protocol")))
        check_str(self.device_name, self._where("device_name"), _MAX_HOST_CHARS,
                  allow_slash=False, allow_empty=True)
        if self.local_hostname is not None:
            check_str(self.local_hostname, self._where("local_hostname"), _MAX_HOST_CHARS,
                      allow_slash=False)
        if self.master_host != AUTO_HOST:
            check_ipv4(self.master_host, self._where("master_host"))
            if self.master_address is not None:
                raise ConfigError(f"{self._where('master_host')}: kvtier starts no master when "
                                  "master_address is given; drop master_host, or drop "
                                  "master_address so kvtier starts one on master_host")
        for name in ("global_segment_size_bytes", "local_buffer_size_bytes"):
            check_int(getattr(self, name), self._where(name), 0, MAX_BYTES)
        check_bool(self.verify_checksums, self._where("verify_checksums"))
        self._set("start_timeout_s", check_float(self.start_timeout_s,
                                                 self._where("start_timeout_s"), 0.1, 600.0))
        self._set("call_timeout_s", check_float(self.call_timeout_s,
                                                self._where("call_timeout_s"), 0.1, 600.0))
        if self.replica_num != AUTO_REPLICAS:
            check_int(self.replica_num, self._where("replica_num") + f" (or {AUTO_REPLICAS!r})",
                      1, MAX_REPLICAS)

    @property
    def copies(self) -> int:
        """Copies each put asks for: `replica_num`, or 1 where "auto" was never resolved
        (a backend opened on its own serves one process)."""
        return 1 if self.replica_num == AUTO_REPLICAS else self.replica_num


@dataclass(frozen=True, slots=True)
class NixlOptions(_Options):
    """NIXL agent: POSIX plugin for files under `root_dir`, UCX for remote host memory."""

    kind: ClassVar[StorageBackendKind] = StorageBackendKind.NIXL
    root_dir: str = "/tmp/kvtier-nixl"
    plugin: NixlPlugin = NixlPlugin.POSIX
    max_size_bytes: int = 0  # 0 = unbounded
    # As FileOptions.verify_checksums (the same objects, headers still checked): off, a
    # flipped payload bit reads as wrong KV instead of a miss, and reads skip the xxh3 of
    # every landed payload, which runs after NIXL's request and adds to it
    # (docs/benchmarks.md has the figures). Turn it off only on trusted storage.
    verify_checksums: bool = True

    def __post_init__(self) -> None:
        check_abs_path(self.root_dir, self._where("root_dir"))
        self._set("plugin", NixlPlugin.parse(self.plugin, self._where("plugin")))
        check_int(self.max_size_bytes, self._where("max_size_bytes"), 0, MAX_BYTES)
        check_bool(self.verify_checksums, self._where("verify_checksums"))


@dataclass(frozen=True, slots=True)
class SimulatedOptions(_Options):
    """Deterministic in-memory backend: transfer time = latency_s + bytes / bandwidth."""

    kind: ClassVar[StorageBackendKind] = StorageBackendKind.SIMULATED
    bandwidth_gbps: float = 10.0  # gigabytes per second
    latency_s: float = 0.0001
    capacity_pages: int = 0  # 0 = unbounded
    seed: int = 0

    def __post_init__(self) -> None:
        self._set("bandwidth_gbps", check_float(self.bandwidth_gbps, self._where("bandwidth_gbps"),
                                                1e-6, 1e6))
        self._set("latency_s", check_float(self.latency_s, self._where("latency_s"), 0.0, 3600.0))
        check_int(self.capacity_pages, self._where("capacity_pages"), 0, 1 << 40)
        check_int(self.seed, self._where("seed"), 0, (1 << 63) - 1)


StorageOptions = FileOptions | MooncakeOptions | NixlOptions | SimulatedOptions

_REGISTRY: dict[StorageBackendKind, type[_Options]] = {
    cls.kind: cls for cls in (FileOptions, MooncakeOptions, NixlOptions, SimulatedOptions)
}


def options_class(kind: StorageBackendKind) -> type[_Options]:
    """The option dataclass of one backend kind."""
    return _REGISTRY[StorageBackendKind.parse(kind, "--hicache-storage-backend")]


def parse_storage_options(kind: StorageBackendKind,
                          d: "Mapping[str, Any] | StorageOptions | None") -> StorageOptions:
    """Validated options for `kind` from a mapping (None or {} = all defaults).

    An options object is accepted as is when it belongs to `kind`.
    """
    cls = options_class(kind)
    if isinstance(d, _Options):
        if not isinstance(d, cls):
            raise ConfigError(f"{EXTRA_CONFIG_FLAG}: {type(d).__name__} given for the "
                              f"{cls.kind.value} backend; use {cls.__name__}")
        return d  # type: ignore[return-value]
    return cls.from_dict(d)  # type: ignore[return-value]
