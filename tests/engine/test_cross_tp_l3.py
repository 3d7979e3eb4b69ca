"""L3 pages are TP-independent: an instance at one TP size hits what one at another stored.

Each instance is a group of rank engines in threads (one collective per group), each rank
with its own HierarchicalCache and its own file-backend client of one shared root; an
in-process page directory publishes a page only when every KV head of it is stored. The tiny
model (6 KV heads) splits at TP 1, 2, 3 and 6. The reader's answer must equal its own cold
answer (same TP size, nothing cached) and the writer's, and come from an L3 hit. Logits are
compared to float rounding: TP sizes sum their all-reduces in different orders, so KV written
at one TP size differs from another's in the last bits (within one size a hit is bit-exact).
That is why the engines run in the default mode, with one-page chunks: deterministic mode
keys its pages by TP size (kvtier.keys.PageCompute), since it promises bit-identity.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import pytest
import torch
from cache_builder import build_cache

from kvtier.config import HiCacheConfig
from kvtier.engine import Engine, SamplingParams, TensorParallel, load_tiny_model
from kvtier.messages import NamespaceSpec
from kvtier.tiers.hierarchical_cache import HierarchicalCache
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.page_store import open_rank_backend
from tests.engine.test_rank_model import ThreadCollective, step_in_threads

PAGE = 16
PARAMS = SamplingParams(max_new_tokens=4)
PROMPT = torch.randint(1, 256, (6 * PAGE + 5,), generator=torch.Generator().manual_seed(3)).tolist()
MAX_STEPS = 200


def _config() -> HiCacheConfig:
    return HiCacheConfig.from_dict({
        "page_size": PAGE, "hicache_ratio": 3.0, "load_back_threshold_tokens": PAGE,
        "prefetch_policy": "wait_complete", "prefetch_threshold_tokens": PAGE,
        "storage_batch_pages": 2}).normalize_for_l3("file")


class Instance:
    """`size` rank engines in lockstep; with `directory`, each rank attaches its own client
    of the namespace (file root `root`) as L3."""

    def __init__(self, size: int, directory: PageDirectory | None = None,
                 root: str = "") -> None:
        self.size, self.coll = size, ThreadCollective(size)
        self.engines: list[Engine] = []
        for rank in range(size):
            tp = TensorParallel(rank, size, reduce_fn=self.coll.reduce_for(rank))
            model = load_tiny_model(torch.float32, "cpu", tp=tp)
            cache = build_cache(model.kv_spec(PAGE), 32, _config(), model="tiny",
                                tp_rank=rank, tp_size=size, directory=directory)
            if directory is not None:
                info = directory.register(namespace_spec(cache, root))
                cache.attach_storage(open_rank_backend(info, cache.heads))
            engine = Engine(model, cache, PAGE, 8192, owns_cache=True)
            engine.scheduler.agree = self.coll.agree_for(rank)
            self.engines.append(engine)

    def answer(self, tokens: list[int]) -> Answer:
        ids = {engine.add_request(tokens, PARAMS) for engine in self.engines}
        req = ids.pop()
        for _ in range(MAX_STEPS):
            for out in self._step()[0]:
                if out.request_id == req:
                    return Answer(tuple(out.tokens), out.prefill_logits)
        raise AssertionError("no answer within the step bound")

    def _step(self) -> list:
        return step_in_threads(self.engines, self.coll)

    def settle(self) -> None:
        """Every backup written and reported (what a running instance does over time)."""
        for engine in self.engines:
            engine.cache.flush()
            engine.cache.storage.drain()

    def storage_hit_tokens(self) -> list[int]:
        return [e.cache.storage.counters.storage_hit_tokens for e in self.engines]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def namespace_spec(cache: HierarchicalCache, root: str) -> NamespaceSpec:
    ns = cache.namespace
    return NamespaceSpec(ns.model, ns.tenant_salt, ns.layout_fingerprint, "file",
                         {"root_dir": root}, kv_heads=cache.heads.total)


class Answer(NamedTuple):
    tokens: tuple[int, ...]
    logits: torch.Tensor  # the last prompt token's (float32)


_COLD: dict[int, Answer] = {}


def cold_answer(size: int) -> Answer:
    if size not in _COLD:
        inst = Instance(size)
        try:
            _COLD[size] = inst.answer(PROMPT)
        finally:
            inst.close()
    return _COLD[size]


@pytest.mark.parametrize("writer_tp, reader_tp", [(1, 3), (3, 1), (2, 6), (6, 2)])
def test_a_reader_of_another_tp_size_hits_what_a_writer_stored(tmp_path, writer_tp, reader_tp):
    root = str(tmp_path / "l3")
    with PageDirectory() as directory:
        writer = Instance(writer_tp, directory, root)
        try:
            written = writer.answer(PROMPT)
            writer.settle()
        finally:
            writer.close()
        ns = directory.namespaces()
        assert len(ns) == 1  # one namespace for every TP size of the model
        assert directory.stats(ns[0]).published_pages >= len(PROMPT) // PAGE
        reader = Instance(reader_tp, directory, root)
        try:
            read = reader.answer(PROMPT)
            hits = reader.storage_hit_tokens()
        finally:
            reader.close()
    cold = cold_answer(reader_tp)
    assert read.tokens == cold.tokens == written.tokens
    # Another TP size sums its all-reduces in another order, so the KV it stored differs
    # from the reader's own in the last bits (within one TP size a hit is bit for bit).
    torch.testing.assert_close(read.logits, cold.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(read.logits, written.logits, rtol=1e-5, atol=1e-5)
    assert hits == [hits[0]] * reader_tp and hits[0] >= (len(PROMPT) // PAGE - 1) * PAGE
    names = os.listdir(os.path.join(root, ns[0], "kv"))
    assert names and all("_h" in n for n in names)  # objects name heads, never ranks


def test_a_page_missing_one_head_is_a_miss(tmp_path):
    """Delete one head's object of one page: the rebuilt directory does not publish it, and a
    reader of another TP size stops its hit before it, answering as cold."""
    root = str(tmp_path / "l3")
    with PageDirectory() as directory:
        writer = Instance(2, directory, root)
        try:
            writer.answer(PROMPT)
            writer.settle()
        finally:
            writer.close()
        ns = directory.namespaces()[0]
        pages = directory.info(ns).spec.key_namespace.page_hashes(PROMPT, PAGE)
        os.unlink(os.path.join(root, ns, "kv", f"{pages[2]}_h4_v"))  # head 4 of page 2
        directory.rebuild(ns)  # e.g. a restarted namespace actor: lists what is stored
        assert directory.lookup(ns, pages).hit_pages == 2
        assert directory.stats(ns).pending_pages == 1  # five heads of six: not published
        reader = Instance(3, directory, root)
        try:
            read = reader.answer(PROMPT)
            hits = reader.storage_hit_tokens()
        finally:
            reader.close()
    assert read.tokens == cold_answer(3).tokens
    torch.testing.assert_close(read.logits, cold_answer(3).logits, rtol=1e-5, atol=1e-5)
    assert hits == [2 * PAGE] * 3  # the two pages before the gap, never the torn one
