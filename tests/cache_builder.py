"""How a test builds a HierarchicalCache: `build_cache(spec, device_pages, **knobs)` on the CPU,
with every default a test does not care about. A plain module (as eventually.py), not a
conftest fixture: module-level helpers and hypothesis tests build caches too, and the
packages' conftest.py files cannot be imported by name (they are all `conftest`)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvtier.config import HiCacheConfig
from kvtier.kv_spec import KVSpec
from kvtier.tiers.hierarchical_cache import HierarchicalCache

if TYPE_CHECKING:
    from kvtier.backends.base import StorageBackend
    from kvtier.tiers.storage_types import PageDirectoryClient


def build_cache(spec: KVSpec, device_pages: int = 32, config: HiCacheConfig | None = None, *,
                model: str = "m", tenant_salt: str = "", storage: StorageBackend | None = None,
                tp_rank: int = 0, tp_size: int = 1,
                directory: PageDirectoryClient | None = None, deterministic: bool = False,
                **knobs: Any) -> HierarchicalCache:
    """A CPU cache of `device_pages` L1 pages of `spec`. Its config is `config`, or else one
    built from `knobs` (HiCacheConfig's fields; enums may be strings) at `spec`'s page size.
    The keyword arguments after `config` are HierarchicalCache's own."""
    if config is None:
        config = HiCacheConfig.from_dict({"page_size": spec.page_size, **knobs})
    elif knobs:
        raise TypeError(f"pass either a config or its knobs, not both: {sorted(knobs)}")
    return HierarchicalCache(config, spec, device_pages, device="cpu", model=model,
                             tenant_salt=tenant_salt, storage=storage, tp_rank=tp_rank,
                             tp_size=tp_size, directory=directory, deterministic=deterministic)


def directory_cache(spec: KVSpec, directory: PageDirectoryClient | None,
                    storage: StorageBackend | None = None) -> HierarchicalCache:
    """A 32-page cache whose L3 hits are what an L3 namespace's `directory` published: it
    writes through to L3 in batches of 3 pages (`page_head`) and waits for whole prefetches,
    so the directory's view is settled when a call returns."""
    from kvtier.policies import PrefetchPolicy, WritePolicy

    return build_cache(spec, 32, storage=storage, directory=directory,
                       write_policy=WritePolicy.WRITE_THROUGH,
                       prefetch_policy=PrefetchPolicy.WAIT_COMPLETE, hicache_ratio=2.0,
                       prefetch_threshold_tokens=8, load_back_threshold_tokens=4,
                       storage_batch_pages=3, mem_layout="page_head")
