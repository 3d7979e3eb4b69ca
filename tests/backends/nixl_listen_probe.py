"""Run by test_nixl_listeners (a fresh process): a NIXL backend moves pages, then prints
what this process listens on."""
import os, tempfile, torch
from kvtier.backends.registry import create_backend
from kvtier.backends.base import StorageTarget, KV_POOL
from kvtier.keys import KeyNamespace
from kvtier.kv_spec import KVSpec
from kvtier.policies import MemLayout
from kvtier.tiers.host_pool import HostPool
from kvtier.netcheck import listening
spec = KVSpec(num_layers=2, num_kv_heads=1, head_dim=8, page_size=4, dtype=torch.float32)
pool = HostPool(spec, 8, MemLayout.PAGE_HEAD)
with tempfile.TemporaryDirectory() as d:
    b = create_backend("nixl", StorageTarget(KeyNamespace("m")), {"root_dir": d})
    b.register_pool(KV_POOL, pool)
    keys = KeyNamespace("m").page_hashes(list(range(8)), 4)
    print(b.set_from(KV_POOL, keys, [0, 1]).ok, b.get_into(KV_POOL, keys, [2, 3]).ok)
    print(listening([os.getpid()]))
    b.close()
