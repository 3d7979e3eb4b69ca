"""Prefetching from a peer's L2: the pages of a prompt another instance holds in host memory,
read into this rank's L2 like an L3 prefetch (docs/architecture.md, "Peer-to-peer L2").

`StorageTier.prefetch` asks the namespace directory for the peer holding the longest leading
run of the pages past the local hit (`best_peer`), and when that run is longer than what L3
has published, the prefetch reads from the peer instead of L3: same ticket, same prefetch
policy and timeout, same agreement (every TP rank takes the MIN that landed on all of them),
same all-or-nothing per page. Only the mover differs: a `PeerWorker` runs the ticket's
batches through this rank's `PeerPages` reader (tiers/peer_pages.py), which reads the
holder's ranks' tables of where the pages lie and pulls them with one one-sided transport
read per holder rank, verified against the sums the tables list. A page the holder no longer
has, or whose bytes changed after the look-up, ends the run (a miss, never wrong bytes); a
holder that is gone is a miss of the whole batch.
"""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import NamedTuple, Protocol, Sequence

from kvtier.backends.base import PagesStillInUse, TransferResult
from kvtier.messages import PeerContact
from kvtier.tiers.storage_worker import StorageOp, StorageWorker


class PeerReadResult(Protocol):
    """What a peer read answers (tiers/peer_pages.PeerRead is one)."""

    pages: int  # leading pages that arrived whole and verified
    bytes: int

    @property
    def transport_may_write(self) -> bool:
        """The read timed out: its transport may still write the pages for a while."""
        ...


class PeerPages(Protocol):
    """This rank's reader of peers' L2 pages (tiers/peer_pages.PeerReader)."""

    def read(self, contact: PeerContact, keys: Sequence[str], first_page: int,
             pages: Sequence[int]) -> PeerReadResult: ...


# How long a transport may go on writing after a read it was asked to give up timed out
# (Mooncake's own transfer timeout is 30 s by default: TransportEndpoint.read); until then the
# read's pages stay quarantined, then they are freed.
TRANSPORT_LINGER_S = 60.0


def _after(seconds: float) -> Future:
    """A future done `seconds` from now."""
    done: Future = Future()
    timer = threading.Timer(seconds, done.set_result, (None,))
    timer.daemon = True
    timer.start()
    return done


class PeerFetch(NamedTuple):
    """A prefetch from a peer: whose L2 (`contact`), and the prompt page the op's first page
    is (`first_page`); the op's keys are the pages' chain keys."""

    contact: PeerContact
    first_page: int


class PeerWorker(StorageWorker):
    """A storage worker whose prefetch batches read from a peer's L2 (never backs up)."""

    def __init__(self, reader: PeerPages, batch_pages: int = 128) -> None:
        super().__init__(None, batch_pages)  # type: ignore[arg-type] - no backend: peers
        self.reader = reader

    def _move(self, op: StorageOp, start: int, pages: list[int],
              is_prefetch: bool) -> TransferResult:
        fetch = op.payload
        if not is_prefetch or not isinstance(fetch, PeerFetch):
            raise TypeError("a peer worker only prefetches PeerFetch ops")
        keys = op.keys[start:start + len(pages)]
        read = self.reader.read(fetch.contact, keys, fetch.first_page + start, pages)
        if read.transport_may_write:
            raise PagesStillInUse(f"a read from peer {fetch.contact.holder} timed out and its "
                                  "transport may still write the pages",
                                  _after(TRANSPORT_LINGER_S))
        got = max(0, min(int(read.pages), len(pages)))
        return TransferResult([True] * got + [False] * (len(pages) - got), int(read.bytes))
