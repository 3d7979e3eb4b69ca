"""Property tests: random operation sequences against a naive model of page contents.

Every page id carries the prefix it is supposed to hold (as if it held that prefix's KV); the
model copies contents exactly as the real cache would copy bytes. A match then must return
pages whose contents are the query's prefixes, and every sized counter must equal a walk.
"""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvtier.tiers.allocator import PageAllocator
from kvtier.tiers.load_back import plan_load_back
from kvtier.tiers.radix_tree import HiRadixTree
from kvtier.tiers.tree_types import LoadRefusal

PAGE = 2
DEVICE_PAGES = 20
HOST_PAGES = 40
seqs = st.lists(st.integers(0, 2), min_size=0, max_size=13)


def prefix_key(tokens, page_index):
    return tuple(tokens[: (page_index + 1) * PAGE])


def node_tokens(node):
    parts = []
    while node.parent is not None:
        parts.append(node.key)
        node = node.parent
    out = []
    for part in reversed(parts):
        out.extend(part)
    return out


class TreeMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dev = PageAllocator(DEVICE_PAGES)
        self.host = PageAllocator(HOST_PAGES)
        self.tree = HiRadixTree(PAGE, self.dev, self.host)
        self.device_content: dict[int, tuple] = {}
        self.host_content: dict[int, tuple] = {}
        self.locks: list = []  # (node, expected prefix tokens, device pages)

    # -- helpers --------------------------------------------------------------------------
    def _write_back(self, node):
        pages = self.host.alloc(len(node.value))
        if pages is None:
            self.tree.evict_host(len(node.value) - self.host.num_free)
            pages = self.host.alloc(len(node.value))
        if pages is None:
            return None
        for d, h in zip(node.value, pages):
            self.host_content[h] = self.device_content[d]
        return pages

    def _stored_prefixes(self):
        stored = set()
        for node in self.tree.nodes():
            toks = node_tokens(node)
            start = len(toks) - len(node.key)
            for end in range(start + PAGE, len(toks) + 1, PAGE):
                stored.add(tuple(toks[:end]))
        return stored

    # -- rules ----------------------------------------------------------------------------
    @rule(tokens=seqs)
    def serve_request(self, tokens):
        """match -> lock -> evict/alloc -> 'compute' -> insert -> free unused -> unlock."""
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.last_device_node)
        need = -(-len(tokens) // PAGE) - len(m.device_indices)
        if need > self.dev.num_free:
            self.tree.evict_device(need - self.dev.num_free)
        pages = self.dev.alloc(need)
        if pages is not None:
            for i, page in enumerate(pages):
                self.device_content[page] = prefix_key(tokens, len(m.device_indices) + i)
            res = self.tree.insert(tokens, m.device_indices + pages)
            self.dev.free(res.unused_pages)
            assert set(res.unused_pages) <= set(pages)
        self.tree.unlock(m.last_device_node)

    @rule(tokens=seqs)
    def match(self, tokens):
        m = self.tree.match_prefix(tokens)
        for i, page in enumerate(m.device_indices):
            assert self.device_content[page] == prefix_key(tokens, i)
        stored = self._stored_prefixes()
        longest = 0
        for end in range(PAGE, len(tokens) // PAGE * PAGE + 1, PAGE):
            if tuple(tokens[:end]) in stored:
                longest = end
            else:
                break
        assert m.hit_length == longest, (m.hit_length, longest)
        if m.last_host_node.parent is not None:
            assert m.last_host_node.host_value is not None

    @rule(tokens=seqs)
    def lock_prefix(self, tokens):
        m = self.tree.match_prefix(tokens)
        self.tree.lock(m.last_device_node)
        self.locks.append((m.last_device_node, tuple(tokens[: m.device_hit_length]), m.device_indices))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock_prefix(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _, _ = self.locks.pop(i)
        self.tree.unlock(node)

    @rule(n=st.integers(1, DEVICE_PAGES))
    def evict_device(self, n):
        self.tree.evict_device(n)

    @rule(n=st.integers(1, HOST_PAGES))
    def evict_host(self, n):
        self.tree.evict_host(n)

    @rule(on=st.booleans())
    def toggle_write_back(self, on):
        self.tree.write_back = self._write_back if on else None

    @rule(data=st.data())
    def backup(self, data):
        """Write-through: give some L1-only node an L2 copy."""
        candidates = [n for n in self.tree.nodes() if n.value is not None and n.host_value is None]
        if not candidates:
            return
        node = data.draw(st.sampled_from(sorted(candidates, key=lambda n: n.id)))
        pages = self.host.alloc(len(node.value))
        if pages is None:
            return
        for d, h in zip(node.value, pages):
            self.host_content[h] = self.device_content[d]
        self.tree.set_backup(node, pages)

    @rule(tokens=seqs, threshold=st.sampled_from([0, 2, 6]), quota=st.sampled_from([None, 1, 3]))
    def load_back(self, tokens, threshold, quota):
        m = self.tree.match_prefix(tokens)
        plan = plan_load_back(self.tree, m.last_host_node, threshold, quota)
        if isinstance(plan, LoadRefusal):
            return
        assert plan.num_tokens >= threshold
        assert quota is None or len(plan.device_pages) <= quota
        for h, d in zip(plan.host_pages, plan.device_pages):
            self.device_content[d] = self.host_content[h]
        after = self.tree.match_prefix(tokens)
        assert after.device_hit_length >= m.device_hit_length + plan.num_tokens

    @rule(tokens=seqs)
    def insert_from_l3(self, tokens):
        """Pages arriving from L3 land in L2 only."""
        n = -(-len(tokens) // PAGE)
        pages = self.host.alloc(n)
        if pages is None:
            return
        for i, page in enumerate(pages):
            self.host_content[page] = prefix_key(tokens, i)
        res = self.tree.insert_host(tokens, pages)
        self.host.free(res.unused_pages)

    @rule(tokens=seqs, skip=st.integers(0, 6))
    def insert_from_l3_after_local_hit(self, tokens, skip):
        """L3 pages continuing a prefix the tree holds (or held: then they are refused)."""
        full = len(tokens) // PAGE
        skip = min(skip, full)
        n = -(-len(tokens) // PAGE) - skip
        pages = self.host.alloc(n)
        if pages is None:
            return
        for i, page in enumerate(pages):
            self.host_content[page] = prefix_key(tokens, skip + i)
        res = self.tree.insert_host(tokens, pages, skip_pages=skip)
        assert set(res.unused_pages) <= set(pages)
        self.host.free(res.unused_pages)

    # -- invariants -----------------------------------------------------------------------
    @invariant()
    def locked_paths_stay_in_l1(self):
        for node, toks, pages in self.locks:
            n = node
            while n.parent is not None:
                assert n.value is not None and n.lock_ref > 0
                n = n.parent
            for i, page in enumerate(pages):
                assert self.device_content[page] == prefix_key(toks, i)

    @invariant()
    def sizes_add_up_and_nothing_leaks(self):
        de = dp = he = hp = 0
        dev_pages, host_pages = [], []
        for node in self.tree.nodes():
            toks = node_tokens(node)
            base = (len(toks) - len(node.key)) // PAGE
            assert node.value is not None or node.host_value is not None, "empty node kept"
            if node.value is not None:
                assert node.parent.value is not None, "L1 prefix has a hole"
                assert len(node.value) * PAGE == len(node.key)
                dev_pages += node.value
                for i, page in enumerate(node.value):
                    assert self.device_content[page] == prefix_key(toks, base + i)
                if node.lock_ref:
                    dp += len(node.value)
                else:
                    de += len(node.value)
            elif node.host_ref:
                hp += len(node.host_value)
            else:
                he += len(node.host_value)
            if node.host_value is not None:
                assert len(node.host_value) * PAGE == len(node.key)
                host_pages += node.host_value
                for i, page in enumerate(node.host_value):
                    assert self.host_content[page] == prefix_key(toks, base + i), "L2 lost a page"
            assert node.device_children == sum(c.value is not None for c in node.children.values())
            assert node.in_device_lru == node.is_device_candidate()
            assert node.in_host_lru == node.is_host_candidate()
        stats = self.tree.stats()
        assert (stats.device_evictable_pages, stats.device_protected_pages) == (de, dp)
        assert (stats.host_evictable_pages, stats.host_protected_pages) == (he, hp)
        assert stats.num_nodes == len(self.tree.nodes()) + 1
        assert len(dev_pages) == len(set(dev_pages)), "an L1 page is claimed twice"
        assert len(host_pages) == len(set(host_pages)), "an L2 page is claimed twice"
        assert sorted(dev_pages) == self.dev.allocated_pages(), "L1 pages leaked"
        assert sorted(host_pages) == self.host.allocated_pages(), "L2 pages leaked"
        self.dev.check()
        self.host.check()

    def teardown(self):
        for node, _, _ in self.locks:
            self.tree.unlock(node)
        self.tree.clear()
        assert self.dev.num_used == 0 and self.host.num_used == 0


TreeMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTree = TreeMachine.TestCase
