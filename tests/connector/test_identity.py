"""What a vLLM block's key includes: never a page of kvtier's own engine, nor of another
backend, ISA, dtype, block size or checkpoint."""
from __future__ import annotations

import dataclasses
import os

from opened_files import opened
from tiny_llama import make_checkpoint

from kvtier.connector.identity import BlockIdentity, block_namespace, model_identity
from kvtier.engine.hf_dir import HFModelDir
from kvtier.keys import KeyNamespace, layout_fingerprint
from kvtier.kv_spec import KVSpec

BLOCK = BlockIdentity(engine="vllm 0.32.0", attention_backend="CPU_ATTN", device="cpu-avx2",
                      kv_dtype="torch.bfloat16", block_size=32, num_layers=2, total_kv_heads=2,
                      head_dim=16)
TOKENS = list(range(64))


def test_a_vllm_block_never_shares_a_key_with_kvtiers_engine(tmp_path):
    model = str(make_checkpoint(tmp_path / "tiny"))
    assert model_identity(model) == HFModelDir(model).identity()  # one name for the weights
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, page_size=32)
    engine = KeyNamespace(HFModelDir(model).identity(),
                          layout_fingerprint=layout_fingerprint(spec, 2))
    vllm = block_namespace(model, BLOCK)
    assert set(vllm.page_hashes(TOKENS, 32)).isdisjoint(engine.page_hashes(TOKENS, 32))


def test_the_connector_and_the_ranks_name_a_checkpoint_alike(tmp_path):
    """One function makes a model name a namespace's model part, for the ranks and for the
    connector: a directory name with spaces and a trailing '.' is named the same by both
    (the connector kept the '.' off, the ranks kept it)."""
    from kvtier.actors.rank_actor import namespace_model

    model = str(make_checkpoint(tmp_path / "tiny model."))
    digest = HFModelDir(model).digest()[:16]
    assert model_identity(model) == namespace_model(HFModelDir(model)) == \
        f"tiny-model.-{digest}"
    KeyNamespace(model_identity(model))  # a valid model part
    assert model_identity("org/hub-model") == "org/hub-model"  # a hub name: itself


def test_every_part_of_the_block_identity_changes_the_key():
    keys = {BLOCK.fingerprint()}
    for name, other in (("engine", "vllm 0.33.0"), ("attention_backend", "FLASH_ATTN"),
                        ("device", "cpu-avx512"), ("kv_dtype", "torch.float16"),
                        ("block_size", 64), ("num_layers", 3), ("total_kv_heads", 4),
                        ("head_dim", 32)):
        keys.add(dataclasses.replace(BLOCK, **{name: other}).fingerprint())
    assert len(keys) == 9


def test_the_weights_are_hashed_once_per_host_and_again_when_touched(tmp_path, monkeypatch):
    """Every vLLM process (front end, EngineCore, each worker) names its blocks by the
    checkpoint's digest: the first hashes the weights, the others find it in the host's
    cache (engine/weight_digest.py), until a weight file changes."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    model = str(make_checkpoint(tmp_path / "tiny"))
    reads = opened(monkeypatch, ".safetensors")
    first = model_identity(model)
    assert reads == ["model.safetensors"]
    assert model_identity(model) == first == HFModelDir(model).identity()  # fresh objects
    assert reads == ["model.safetensors"]
    weights = tmp_path / "tiny" / "model.safetensors"
    st = weights.stat()
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert model_identity(model) == first and reads == ["model.safetensors"] * 2


def test_the_engines_config_keys_its_blocks(tmp_path):
    """Revision, config overrides, dtype, quantization and the KV cache dtype each give
    another fingerprint; the same settings the same one."""
    from types import SimpleNamespace

    from kvtier.connector.identity import config_digest

    model = str(make_checkpoint(tmp_path / "tiny"))

    def digest(**changes) -> str:
        mc = SimpleNamespace(**{"model": model, "revision": None, "hf_config_path": None,
                                "hf_overrides": {}, "dtype": "torch.bfloat16",
                                "quantization": None, "model_impl": "auto", **changes})
        cache = SimpleNamespace(cache_dtype=changes.pop("cache_dtype", "auto"),
                                kv_cache_dtype_skip_layers=[])
        return config_digest(mc, cache)

    base = digest()
    assert digest() == base
    others = [digest(revision="v2"), digest(hf_overrides={"rope_theta": 5e5}),
              digest(dtype="torch.float32"), digest(quantization="fp8"),
              digest(cache_dtype="fp8_e4m3")]
    assert len({base, *others}) == 6
    (tmp_path / "tiny" / "config.json").write_text(
        (tmp_path / "tiny" / "config.json").read_text().replace("10000", "20000"))
    assert digest() != base  # the checkpoint's config edited, its weights the same
    assert dataclasses.replace(BLOCK, config=base).fingerprint() != BLOCK.fingerprint()
