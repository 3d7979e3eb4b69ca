"""A hybrid model's namespace: its pages' sliding-window objects (pool `swa`) leave L3 with
the page, when the directory evicts it under its quota and when a purge empties it."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from test_old_format_and_purge import KINDS, SPEC, TOKENS, options, spec, stored_names, write_pages

from kvtier.backends.base import SWA_POOL
from kvtier.kv_spec import HeadRange
from kvtier.messages import NamespaceInfo
from kvtier.policies import MemLayout
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.page_eviction import run_pass
from kvtier.tiers.page_store import open_rank_backend


def write_sliding(info: NamespaceInfo, pages: list[str]) -> None:
    with HostPool(SPEC, len(pages), MemLayout.PAGE_HEAD) as pool, \
            open_rank_backend(info, HeadRange.all_of(SPEC.num_kv_heads)) as backend:
        pool.kv.copy_(torch.randn(pool.kv.shape))
        backend.register_pool(SWA_POOL, pool)
        assert all(backend.set_from(SWA_POOL, pages, list(range(len(pages)))).ok)


def sliding_objects(kind: str, opts: dict, ns: str) -> int:
    return sum(1 for n in stored_names(kind, opts) if n.startswith(f"{ns}/{SWA_POOL}/"))


@pytest.mark.parametrize("kind", KINDS)
def test_evicted_and_purged_pages_take_their_sliding_objects_along(kind, tmp_path):
    opts = options(kind, tmp_path)
    hybrid = dataclasses.replace(spec(kind, opts), sliding=True, max_pages=4)
    pages = hybrid.key_namespace.page_hashes(TOKENS, SPEC.page_size)
    with PageDirectory() as d:
        info = d.register(hybrid)
        ns = info.namespace
        write_pages(info, pages)
        write_sliding(info, pages)
        per_page = 2 * SPEC.num_kv_heads  # K and V of each head
        assert sliding_objects(kind, opts, ns) == len(pages) * per_page
        d.report_stored(ns, pages, HeadRange.all_of(SPEC.num_kv_heads))
        assert run_pass(d).deleted == len(pages) - 4  # the quota: four pages stay
        assert sliding_objects(kind, opts, ns) == 4 * per_page
        assert d.purge(ns) == 4 and run_pass(d).deleted == 4
        assert sliding_objects(kind, opts, ns) == 0
