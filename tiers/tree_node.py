"""One node of the HiRadixTree and the LRU queue of eviction candidates."""
from __future__ import annotations

import heapq
from typing import Callable, Iterator, Sequence


NOT_STORED = 0
STORED = -1


def as_key(tokens: Sequence[int]) -> tuple:
    """Token ids as a node key (a tuple), from a list, tuple or tensor."""
    if isinstance(tokens, tuple):
        return tokens
    if hasattr(tokens, "tolist"):
        return tuple(tokens.tolist())
    return tuple(tokens)


class TreeNode:
    """A run of whole pages of one prefix, and where those pages live.

    Each cache salt has a root of its own, so prefixes of different salts never match.
    `value` holds the L1 page ids (None once evicted from L1), `host_value` the L2 page ids
    (None when not backed up). `lock_ref` protects the L1 pages of the path from this node to
    the root (requests running on it, writes in flight); `host_ref` protects the L2 pages of
    that path (loads and backups in flight). `pin_ref` counts the pins (tiers/cache_pins)
    whose prefix runs through this node: its L2 pages are never evicted while it is above 0.
    All three are path counts, so a split copies them.
    """

    __slots__ = (
        "id", "key", "parent", "children", "value", "host_value", "lock_ref", "host_ref",
        "hit_count", "last_access", "device_children", "in_device_lru", "in_host_lru",
        "storage_op", "salt", "pin_ref",
    )

    def __init__(self, node_id: int, key: tuple, parent: "TreeNode | None",
                 salt: str = "") -> None:
        self.id = node_id
        self.key = key  # token ids, a whole number of pages
        self.parent = parent
        # the cache salt of the prefix (a tenant's): its root's, so its page keys' chain seed
        self.salt = parent.salt if parent is not None else salt
        self.children: dict[tuple, TreeNode] = {}  # first page of the child's key -> child
        self.value: list[int] | None = None
        self.host_value: list[int] | None = None
        self.lock_ref = 0
        self.host_ref = 0
        self.pin_ref = 0  # pins through this node: L2 eviction skips it
        self.hit_count = 0
        self.last_access = 0
        self.device_children = 0  # children whose value is not None
        self.in_device_lru = False
        self.in_host_lru = False
        # L3 state of the pages: NOT_STORED, STORED, or the id (> 0) of the backup writing them
        self.storage_op = NOT_STORED

    @property
    def on_device(self) -> bool:
        return self.value is not None

    @property
    def backed_up(self) -> bool:
        return self.host_value is not None

    @property
    def evicted(self) -> bool:
        """In L2 only: evicted from L1, still backed up."""
        return self.value is None

    @property
    def num_pages(self) -> int:
        return len(self.value if self.value is not None else self.host_value or ())

    def is_device_candidate(self) -> bool:
        return self.value is not None and self.lock_ref == 0 and self.device_children == 0

    def is_host_candidate(self) -> bool:
        return (
            self.value is None and self.host_value is not None and self.host_ref == 0
            and not self.children and not self.pin_ref
        )

    def path_to_root(self) -> Iterator["TreeNode"]:
        node = self
        while node.parent is not None:
            yield node
            node = node.parent

    def descendants(self) -> list["TreeNode"]:
        """Every node below this one (walks the subtree)."""
        out, stack = [], list(self.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, pages={self.num_pages}, device={self.value is not None}, "
            f"host={self.host_value is not None}, lock={self.lock_ref}, host_ref={self.host_ref})"
        )


class LruQueue:
    """Least-recently-used order over a changing set of candidate nodes.

    A heap with lazy invalidation: entries of nodes that stopped being candidates are skipped
    on pop; an entry older than its node's `last_access` (touched since) is pushed again with
    the new stamp, so touching a node costs nothing here. The heap is rebuilt from the member
    set when stale entries pile up.
    """

    __slots__ = ("_heap", "_members", "_flag", "_is_candidate")

    def __init__(self, flag: str, is_candidate: Callable[[TreeNode], bool]) -> None:
        self._heap: list[tuple[int, int, TreeNode]] = []
        self._members: dict[int, TreeNode] = {}
        self._flag = flag  # the TreeNode slot that mirrors membership
        self._is_candidate = is_candidate

    def __len__(self) -> int:
        return len(self._members)

    def refresh(self, node: TreeNode) -> None:
        """Re-evaluate `node` after anything its candidacy depends on changed."""
        member = getattr(node, self._flag)
        if self._is_candidate(node):
            if not member:
                setattr(node, self._flag, True)
                self._members[node.id] = node
                heapq.heappush(self._heap, (node.last_access, node.id, node))
                if len(self._heap) > 4 * len(self._members) + 64:
                    self._rebuild()
        elif member:
            setattr(node, self._flag, False)
            del self._members[node.id]

    def discard(self, node: TreeNode) -> None:
        if getattr(node, self._flag):
            setattr(node, self._flag, False)
            del self._members[node.id]

    def pop(self) -> TreeNode | None:
        """The least recently used candidate (removed from the queue), or None."""
        heap = self._heap
        while heap:
            stamp, _, node = heapq.heappop(heap)
            if not getattr(node, self._flag):
                continue
            if stamp != node.last_access:  # touched since it was queued: requeue
                heapq.heappush(heap, (node.last_access, node.id, node))
                continue
            setattr(node, self._flag, False)
            del self._members[node.id]
            return node
        return None

    def members(self) -> list[TreeNode]:
        return list(self._members.values())

    def _rebuild(self) -> None:
        self._heap = [(n.last_access, n.id, n) for n in self._members.values()]
        heapq.heapify(self._heap)
