"""Errors a caller can trigger. Each message says what to change.

A cache miss is a value, never an exception; `assert` guards internal invariants only.
"""


class KvtierError(Exception):
    """Base class of every error kvtier raises on purpose."""


class ConfigError(KvtierError, ValueError):
    """A setting is invalid or conflicts with another one."""


class InvalidTokensError(KvtierError, ValueError):
    """Token ids that cannot be hashed or stored (empty, negative, beyond uint32, wrong type)."""


class HostMemoryError(KvtierError, MemoryError):
    """The host lacks the memory asked for the L2 pool."""


class AllocatorError(KvtierError, RuntimeError):
    """A page was freed twice, freed while not allocated, or is out of range."""


class TransferError(KvtierError, RuntimeError):
    """A copy between tiers failed or was given mismatched page lists."""


class ClosedError(KvtierError, RuntimeError):
    """The component was used after close()."""


class CacheUsageError(KvtierError, ValueError):
    """The cache was called in a way that breaks its contract (unlock without lock, page
    lists of the wrong length): a bug in the caller, reported instead of corrupting state."""


class UnknownNamespaceError(CacheUsageError):
    """The L3 page directory does not hold this namespace: never registered, or lost when its
    namespace actor restarted without it (a failed restore, a corrupt state file). Register
    its NamespaceSpec again: registration is idempotent."""


class PlacementError(KvtierError, RuntimeError):
    """The Ray cluster cannot place what a deployment asks for (no node offers a custom
    resource, or not enough of it): raised before anything is created, naming the resource,
    the amount needed and the nodes that offer it."""


class ClusterJoinError(KvtierError, ConnectionError):
    """Joining an existing Ray cluster failed (unreachable, or a token it requires is
    missing or wrong)."""


class PinRoomError(KvtierError, RuntimeError):
    """A pinned prefix does not fit: it needs `needed_pages` more pinned pages than the
    `free_pages` pins may still take in `where` (an instance's L2, the L3 namespace)."""

    def __init__(self, needed_pages: int, free_pages: int, where: str, why: str = "") -> None:
        self.needed_pages, self.free_pages, self.where = needed_pages, free_pages, where
        super().__init__(f"the pin needs {needed_pages} pages, {free_pages} free for pins in "
                         f"{where}{' (' + why + ')' if why else ''}; unpin others, pin a shorter "
                         f"prefix, or raise the pinned share (--pin-max-fraction)")
