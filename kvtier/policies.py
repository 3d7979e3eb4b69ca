"""The enums behind every policy and layout knob. Compare members, never strings."""
from __future__ import annotations

import enum


class _Choice(str, enum.Enum):
    """A str-valued enum whose values are the reference's CLI spellings."""

    @classmethod
    def parse(cls, value: "str | _Choice", flag: str) -> "_Choice":
        from kvtier.errors import ConfigError

        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower().replace("-", "_"))
            except ValueError:
                pass
        choices = ", ".join(m.value for m in cls)
        raise ConfigError(f"{flag}: {value!r} is not one of: {choices}")

    def __str__(self) -> str:  # logs and CLI show the plain spelling
        return self.value


class WritePolicy(_Choice):
    """When L1 pages are copied to L2 (and on to L3)."""

    WRITE_THROUGH = "write_through"  # back up on first insert (hit threshold 1)
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # back up once hit twice
    WRITE_BACK = "write_back"  # copy only when evicted from L1


class IoBackend(_Choice):
    """How L1<->L2 copies run."""

    KERNEL = "kernel"  # batched index copies (gather/scatter) over the pool tensors
    DIRECT = "direct"  # contiguous per-page runs copied straight between pools


class MemLayout(_Choice):
    """Byte order of the L2 host pool."""

    LAYER_FIRST = "layer_first"  # (2, L, tokens, H, D)
    PAGE_FIRST = "page_first"  # (2, tokens, L, H, D)
    PAGE_FIRST_DIRECT = "page_first_direct"  # (2, pages, L, page_size, H, D)
    PAGE_HEAD = "page_head"  # (2, pages, H, L, page_size, D): L3's per-head objects, in place

    @property
    def is_page_major(self) -> bool:
        return self is not MemLayout.LAYER_FIRST

    @property
    def is_head_major(self) -> bool:
        """Is each KV head's share of a page part one contiguous run (an L3 object)?"""
        return self is MemLayout.PAGE_HEAD

    def with_l3(self) -> "MemLayout":
        """L2's layout once L3 is attached (or hand-offs cross TP sizes): the one rule that
        L2 is head-major then, since every backend moves each KV head of a page part as one
        contiguous object in place. Any layout -> page_head; config normalization and a
        cache attaching L3 at run time both ask here."""
        return self if self.is_head_major else MemLayout.PAGE_HEAD


class PrefetchPolicy(_Choice):
    """How long admission waits for L3->L2 prefetches."""

    BEST_EFFORT = "best_effort"  # use whatever arrived by the time the request is scheduled
    WAIT_COMPLETE = "wait_complete"  # wait until the whole prefetch completes
    TIMEOUT = "timeout"  # wait up to a length-dependent timeout


class SchedulePolicy(_Choice):
    """The order in which waiting requests are admitted (SGLang's `--schedule-policy`)."""

    LPM = "lpm"  # longest cached prefix first (what the ranks agreed last step), with aging
    FCFS = "fcfs"  # arrival order


class StorageBackendKind(_Choice):
    """L3 storage backends kvtier ships."""

    FILE = "file"
    MOONCAKE = "mooncake"
    NIXL = "nixl"
    SIMULATED = "simulated"  # deterministic bandwidth/latency model for GPU-free tests


class Transport(_Choice):
    """How pages move between two processes' host pools: a prefill rank writing a request's KV
    into a decode rank's pages, and an instance reading a peer's L2 pages."""

    NIXL = "nixl"  # NIXL agent, UCX backend, between registered pools
    MOONCAKE = "mooncake"  # Mooncake transfer engine (TCP here, RDMA where present)
    SIMULATED = "simulated"  # in-process memmove between registered regions (unit tests only)

    @classmethod
    def across_processes(cls) -> tuple["Transport", ...]:
        """The transports that cross processes: those a deployment may name."""
        return tuple(t for t in cls if t is not cls.SIMULATED)

    @classmethod
    def parse_across(cls, value: "str | Transport", flag: str) -> "Transport":
        """`parse`, refusing the simulated transport (it moves bytes within one process)."""
        from kvtier.errors import ConfigError

        kind = cls.parse(value, flag)
        if kind is cls.SIMULATED:
            names = " or ".join(t.value for t in cls.across_processes())
            raise ConfigError(f"{flag}: simulated moves bytes within one process, and these "
                              f"are separate processes; use {names}")
        return kind


class HostMode(_Choice):
    """What the L2 host pool is for."""

    CACHE = "cache"  # L2 is a cache tier of its own (hits are loaded back from it)
    STORAGE_ONLY = "storage_only"  # L2 only stages pages between L1 and L3


class HitPolicy(_Choice):
    """Which pages of a prefix a storage pool must hold for the prefix to count."""

    ALL_PAGES = "all_pages"
    TRAILING_PAGES = "trailing_pages"


# Cache events (what an instance tells the router; `kvtier.frontend.cache_events`).
class CacheTier(enum.Enum):
    """Where a page is, best first (the order the router prefers)."""

    DEVICE = "device"  # L1
    HOST = "host"  # L2
    STORAGE = "storage"  # L3, shared by every instance of a namespace

    @property
    def rank(self) -> int:
        """0 for L1, 1 for L2, 2 for L3: lower is a cheaper hit."""
        return _TIER_RANK[self]


_TIER_RANK = {CacheTier.DEVICE: 0, CacheTier.HOST: 1, CacheTier.STORAGE: 2}


class CacheEventKind(enum.Enum):
    STORED = "stored"  # the pages are now in `tier`
    DEMOTED = "demoted"  # the pages left L1 (tier DEVICE) and are still in L2
    EVICTED = "evicted"  # the pages are gone from `tier`
