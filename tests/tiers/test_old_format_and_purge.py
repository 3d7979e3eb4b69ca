"""Objects of the old format (named by TP rank and size) are never read, and a rebuild
reclaims and counts them; a purge empties a namespace on purpose."""
from __future__ import annotations

import os
import uuid

import pytest
import torch

from kvtier.backends import simulated
from kvtier.backends.file_object import write_object
from kvtier.errors import CacheUsageError, ConfigError
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import HeadRange, KVSpec
from kvtier.messages import NamespaceInfo, NamespaceSpec
from kvtier.policies import MemLayout
from kvtier.tiers.host_pool import HostPool
from kvtier.tiers.page_directory import PageDirectory
from kvtier.tiers.page_eviction import run_pass
from kvtier.tiers.page_store import open_rank_backend

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)
TOKENS = list(range(24))  # 6 pages
KINDS = ["file", "simulated", "nixl"]


def options(kind: str, tmp_path) -> dict:
    if kind == "nixl":
        pytest.importorskip("nixl")
    return {"seed": uuid.uuid4().int >> 65} if kind == "simulated" else {"root_dir": str(tmp_path)}


def spec(kind: str, opts: dict, model: str = "org/model") -> NamespaceSpec:
    return NamespaceSpec(model, "t", "fp2", kind, opts, kv_heads=SPEC.num_kv_heads)


def write_pages(info: NamespaceInfo, pages: list[str]) -> None:
    """What a TP=1 rank does: every head of `pages`, with its own client."""
    with HostPool(SPEC, len(pages), MemLayout.PAGE_HEAD) as pool, \
            open_rank_backend(info, HeadRange.all_of(SPEC.num_kv_heads)) as backend:
        pool.kv.copy_(torch.randn(pool.kv.shape))
        backend.register_pool("kv", pool)
        assert all(backend.set_from("kv", pages, list(range(len(pages)))).ok)


def put_old_object(kind: str, opts: dict, name: str) -> None:
    """An object as format 1 named it (the bytes are a page part's; the name is what counts)."""
    payload = memoryview(bytes(range(64)))
    if kind == "simulated":
        with simulated._LOCK:
            simulated._STORES.setdefault(opts["seed"], {})[name] = (bytes(payload), 0)
        return
    path = os.path.join(opts["root_dir"], name)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    assert write_object(path, name.encode(), payload, False).status.name == "WRITTEN"


def stored_names(kind: str, opts: dict) -> set[str]:
    if kind == "simulated":
        return set(simulated._STORES.get(opts["seed"], {}))
    root = opts["root_dir"]
    return {os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root)
            for f in files if not f.startswith(".")}


@pytest.mark.parametrize("kind", KINDS)
def test_old_format_objects_are_never_read_and_are_reclaimed(kind, tmp_path):
    opts = options(kind, tmp_path)
    new = spec(kind, opts)
    info = NamespaceInfo(new.namespace, new, opts)
    pages = new.key_namespace.page_hashes(TOKENS, SPEC.page_size)
    write_pages(info, pages[:3])
    old_ns = KeyNamespace("org/model", "t", "v1-fingerprint").name  # where v1 wrote them
    other_model = KeyNamespace("org/other", "t", "v1-fingerprint").name
    old = [f"{old_ns}/kv/{h}_{r}_2_{p}" for h in pages for r in (0, 1) for p in "kv"]
    old += [f"{new.namespace}/kv/{h}_0_1_{p}" for h in pages[3:5] for p in "kv"]  # in-place
    foreign = [f"{other_model}/kv/{pages[0]}_0_1_{p}" for p in "kv"]  # another model's
    for name in old + foreign:
        put_old_object(kind, opts, name)
    with HostPool(SPEC, 8, MemLayout.PAGE_HEAD) as pool, open_rank_backend(info) as reader:
        reader.register_pool("kv", pool)
        assert reader.exists(pages).usable_pages == 3  # old names are never v2 objects
        assert reader.get_into("kv", pages[3:5], [0, 1]).ok == [False, False]
    with PageDirectory() as d:
        ns = d.register(new).namespace
        assert d.rebuild(ns) == 3
        stats = d.stats(ns)
    assert stats.old_format_pages_reclaimed == len(pages) + 2  # per namespace folder
    left = stored_names(kind, opts)
    assert not left & set(old)
    assert set(foreign) <= left  # another model's objects are not this namespace's to take
    assert sum(1 for n in left if n.startswith(f"{new.namespace}/kv/")) == 3 * 2 * 2


@pytest.mark.parametrize("kind", ["file", "simulated"])
def test_purge_deletes_every_page_and_starts_a_new_epoch(kind, tmp_path):
    opts = options(kind, tmp_path)
    new = spec(kind, opts)
    pages = new.key_namespace.page_hashes(TOKENS, SPEC.page_size)
    with PageDirectory() as d:
        info = d.register(new)
        ns = info.namespace
        write_pages(info, pages[:4])
        d.report_stored(ns, pages[:4], HeadRange.all_of(2))
        d.report_stored(ns, pages[4:], HeadRange(0, 1, 2))  # half written: pending
        half = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)
        with HostPool(half, 2, MemLayout.PAGE_HEAD) as pool, \
                open_rank_backend(info, HeadRange(1, 2, 2)) as late:  # stored, never reported
            late.register_pool("kv", pool)
            assert all(late.set_from("kv", pages[4:], [0, 1]).ok)
        lease = d.lookup(ns, pages, lease_ttl_s=30).lease_id
        assert d.purge(ns) == len(pages)  # published, pending and listed: every page once
        s = d.stats(ns)
        assert (s.published_pages, s.pending_pages, s.leases_active) == (0, 0, 0)
        assert s.purged_pages == len(pages) and s.epoch == info.epoch + 1
        assert d.lookup(ns, pages).hit_pages == 0 and not d.release(lease)
        assert d.report_stored(ns, pages[:1], HeadRange.all_of(2)) == []  # doomed until gone
        assert run_pass(d).deleted == len(pages)
        assert not any(n.startswith(f"{ns}/") for n in stored_names(kind, opts))
        assert d.report_stored(ns, pages[:1], HeadRange.all_of(2)) == pages[:1]  # backed up again
        assert d.purge(ns) == 1 and d.info(ns).epoch == info.epoch + 2


def test_a_rank_of_another_model_is_refused_with_a_clear_error(tmp_path):
    """Any TP size of the same model shares the namespace; another head count is another
    model: its rank client is refused, and so is its report to the directory."""
    new = spec("file", {"root_dir": str(tmp_path)})  # 2 KV heads
    info = NamespaceInfo(new.namespace, new, new.options)
    with pytest.raises(ConfigError, match="2 KV heads, this rank's model has 6"):
        open_rank_backend(info, HeadRange(0, 3, 6))
    with open_rank_backend(info, HeadRange(1, 2, 2)):  # TP=2 rank 1: fine
        pass
    with PageDirectory() as d:
        ns = d.register(new).namespace
        with pytest.raises(CacheUsageError, match="with 2 KV heads"):
            d.report_stored(ns, new.key_namespace.page_hashes(TOKENS, 4), HeadRange(0, 1, 3))
