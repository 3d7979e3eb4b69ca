"""Every place that computes an L3 namespace's fingerprint agrees on the engine's mode: the
rank's cache (RankSettings.deterministic), the namespace the demo and the benches register
(kvtier.cli.demo.namespace_spec) and the Engine's own check, so a deterministic deployment never
attaches a namespace of batched pages (no Ray: ranks in-process)."""
from __future__ import annotations

import pytest
import torch
from cache_builder import build_cache

from kvtier.actors.l3.namespace_actor import FakeNamespaceClient
from kvtier.actors.rank_actor import CacheDescription, Rank, RankSettings
from kvtier.config import HiCacheConfig
from kvtier.cli.demo import namespace_spec
from kvtier.engine.engine import Engine
from kvtier.engine.loader import load_tiny_model
from kvtier.engine.weight_sources import TinyWeights
from kvtier.errors import ConfigError
from kvtier.messages import unpack_record

PAGE = 16
CONFIG = HiCacheConfig(page_size=PAGE)
SETTINGS = RankSettings(TinyWeights(seed=6), CONFIG, device_pages=16, dtype=torch.float32,
                        chunk_tokens=PAGE, tenant_salt="modes")


def spec(root, deterministic: bool):
    return namespace_spec(SETTINGS.source, CONFIG, "file", str(root), "tiny", "modes",
                          dtype=SETTINGS.dtype, page_size=PAGE, deterministic=deterministic)


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_rank_and_the_registered_namespace_agree_on_the_mode(tmp_path, deterministic):
    with FakeNamespaceClient() as client:
        info = client.register(spec(tmp_path, deterministic))
        other = client.register(spec(tmp_path, not deterministic))
        assert info.namespace != other.namespace
        rank = Rank(0, 1, "", SETTINGS._replace(deterministic=deterministic))
        try:
            desc = unpack_record(CacheDescription, rank.describe())
            assert desc.layout_fingerprint == info.spec.layout_fingerprint
            with pytest.raises(ConfigError, match="layout fingerprint"):
                rank.attach_l3(other.to_msgpack(), None)  # the other mode's pages: refused
            assert rank.attach_l3(info.to_msgpack(), None) == "file"
        finally:
            rank.close()


def test_an_engine_refuses_a_shared_cache_keyed_for_the_other_mode(tmp_path):
    model = load_tiny_model(torch.float32, "cpu")
    config = HiCacheConfig(page_size=PAGE, storage_backend="file",
                           storage_options={"root_dir": str(tmp_path)})
    for deterministic in (False, True):
        cache = build_cache(model.kv_spec(PAGE), 16, config, model="tiny",
                            deterministic=not deterministic)
        with cache, pytest.raises(ConfigError, match="deterministic="):
            Engine(model, cache, deterministic=deterministic)
    private = build_cache(model.kv_spec(PAGE), 16, model="tiny")  # no L3: its pages stay here
    with Engine(model, private, owns_cache=True, deterministic=True):
        pass
