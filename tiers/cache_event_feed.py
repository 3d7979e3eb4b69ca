"""The cache's event feed: which pages entered or left each tier, told as page hashes.

A router (frontend/cache_events, actors/serve_router) keeps an approximate index of what each
instance holds; it hashes a request's tokens with the namespace's chain keys, so events speak
the same keys. L1 events come from the tree as they happen; an L2 entry is told when its copy
has landed, an L3 entry when this rank's backup has written it. With no listener nothing is
computed (hashing walks a node's whole prefix).
"""
from __future__ import annotations

from typing import Callable, Sequence

from kvtier.keys import KeyNamespace
from kvtier.policies import CacheEventKind, CacheTier
from kvtier.tiers.storage_types import node_tokens
from kvtier.tiers.storage_worker import StorageOp
from kvtier.tiers.tree_node import TreeNode

# fn(kind, tier, page_hashes): pages (the namespace's chain keys, prefix order) changed tier.
CacheEventListener = Callable[[CacheEventKind, CacheTier, "list[str]"], None]


class CacheEventFeed:
    """Turns tree changes, landed L2 copies and ended L3 backups into listener calls."""

    def __init__(self, namespace: KeyNamespace, page_size: int) -> None:
        self.namespace, self.page_size = namespace, page_size
        self.listener: CacheEventListener | None = None
        self._storing: list[StorageOp] = []  # L3 backups whose end is still to be told

    @property
    def active(self) -> bool:
        return self.listener is not None

    def node_hashes(self, node: TreeNode) -> list[str]:
        """The chain keys of `node`'s own pages (hashing walks its whole prefix)."""
        pages = len(node.key) // self.page_size
        keys = self.namespace.page_hashes(node_tokens(node), self.page_size, node.salt)
        return keys[len(keys) - pages:]

    def on_tree_event(self, kind: CacheEventKind, tier: CacheTier, node: TreeNode,
                      hashes: Sequence[str] | None = None) -> None:
        """Tell the listener; `hashes`: the node's, when the caller took them already."""
        if self.listener is not None:
            self.listener(kind, tier, self.node_hashes(node) if hashes is None else hashes)

    def host_landed(self, hashes: list[str] | None) -> None:
        """An L1->L2 copy landed (its hashes were taken when it started: the node may have
        split since)."""
        if hashes and self.listener is not None:
            self.listener(CacheEventKind.STORED, CacheTier.HOST, hashes)

    def backup_started(self, op: StorageOp | None) -> None:
        if op is not None and self.listener is not None:
            self._storing.append(op)

    def tell_stored(self) -> None:
        """Tell the listener about L3 backups that ended (their written leading pages)."""
        if not self._storing:
            return
        running: list[StorageOp] = []
        ended: list[StorageOp] = []
        for op in self._storing:  # one look at each state: the worker thread may finish it
            (ended if op.state.finished else running).append(op)
        self._storing = running
        for op in ended:
            if op.done_pages and self.listener is not None:
                self.listener(CacheEventKind.STORED, CacheTier.STORAGE, op.keys[:op.done_pages])

    def forget(self) -> None:
        """The listener went away: nothing pending is told."""
        self._storing.clear()
