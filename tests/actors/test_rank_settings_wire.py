"""RankSettings cross to a rank actor as a msgpack record, never pickled: each weight source
kind travels as a small record the rank rebuilds it from, the cache config as its validated
dict; weights at a path that are not the ones the driver hashed are refused on the rank."""
from __future__ import annotations

import json

import msgpack
import pytest
import torch
from safetensors.torch import save_file

from kvtier.actors.rank_actor import (RankSettings, RankSettingsRecord, pack_rank_settings,
                                      unpack_rank_settings)
from kvtier.config import HiCacheConfig, HiCacheConfigRecord
from kvtier.dtypes import DType
from kvtier.engine.gemma3_package import Gemma3Weights
from kvtier.engine.gguf_file import GGUFFile
from kvtier.engine.hf_dir import HFModelDir
from kvtier.engine.model_config import tiny_config
from kvtier.engine.weight_source_record import (WeightsChangedError, WeightSourceKind,
                                                source_record)
from kvtier.engine.weight_sources import SmolLM2Weights, TinyWeights
from kvtier.errors import ConfigError
from kvtier.messages import MessageError, NamespaceInfo, NamespaceSpec, pack_record, \
    unpack_record
from kvtier.policies import SchedulePolicy

CONFIG = HiCacheConfig.from_dict({"page_size": 16, "write_policy": "write_back",
                                  "storage_backend": "file",
                                  "storage_options": {"root_dir": "/data/l3", "fsync": True}})


def model_dir(root, seed: int = 0) -> HFModelDir:
    """A directory with what a digest reads: config.json and safetensors weights."""
    root.mkdir(exist_ok=True)
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    save_file({"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(seed))},
              str(root / "model.safetensors"))
    return HFModelDir(str(root))


def settings(source) -> RankSettings:
    return RankSettings(source, CONFIG, device_pages=48, dtype=DType.BF16, chunk_tokens=64,
                        token_budget=128, timeout_s=30.0, l3_actor=None, tenant_salt="acme",
                        deterministic=True, schedule_policy=SchedulePolicy.FCFS, gpu=True)


def round_trip(s: RankSettings) -> RankSettings:
    packed = pack_rank_settings(s)
    assert isinstance(packed.data, bytes) and packed.gpu is s.gpu
    return unpack_rank_settings(packed.data)


def test_the_record_has_every_field_of_the_settings() -> None:
    assert RankSettingsRecord._fields == RankSettings._fields


@pytest.mark.parametrize("kind", list(WeightSourceKind))
def test_settings_round_trip_for_each_weight_source_kind(kind, tmp_path) -> None:
    source = {
        WeightSourceKind.TINY: lambda: TinyWeights(7, tiny_config(vocab_size=300, num_layers=3)),
        WeightSourceKind.SMOLLM2: lambda: SmolLM2Weights(str(tmp_path / "cache")),
        WeightSourceKind.GEMMA3: lambda: Gemma3Weights(str(tmp_path / "cache")),
        WeightSourceKind.HF_DIR: lambda: model_dir(tmp_path / "model"),
        WeightSourceKind.GGUF: packaged_gguf,
    }[kind]()
    s = settings(source)
    assert source_record(source).kind is kind
    got = round_trip(s)
    assert got == s and type(got.source) is type(source)
    assert got.config.storage_options == CONFIG.storage_options
    assert got.config.explicit == CONFIG.explicit


def packaged_gguf() -> GGUFFile:
    from kvtier.engine.gguf_source import find_gguf

    pytest.importorskip("gguf")
    return GGUFFile(str(find_gguf()))  # converted once into the user's cache (~15 s)


def test_a_torch_dtype_travels_as_the_choice_that_resolves_to_it() -> None:
    s = settings(TinyWeights())
    assert round_trip(s._replace(dtype=torch.float32)).dtype is DType.FP32
    assert round_trip(s._replace(dtype=torch.bfloat16)).dtype is DType.BF16
    with pytest.raises(ConfigError, match="RankSettings.dtype"):
        pack_rank_settings(s._replace(dtype=torch.float16))


def test_an_l3_namespace_travels_as_its_record() -> None:
    spec = NamespaceSpec("tiny", "acme", "fp", options={"root_dir": "/data/l3"}, kv_heads=6)
    info = NamespaceInfo(spec.namespace, spec, {"root_dir": "/data/l3"}, epoch=3)
    s = settings(TinyWeights())._replace(l3=info, l3_actor="kvtier-l3")
    assert round_trip(s) == s


def test_a_changed_model_directory_is_refused_on_the_rank(tmp_path) -> None:
    source = model_dir(tmp_path / "model", seed=0)
    packed = pack_rank_settings(settings(source))
    model_dir(tmp_path / "model", seed=1)  # the weights change after the driver hashed them
    with pytest.raises(WeightsChangedError, match="not the ones the driver hashed"):
        unpack_rank_settings(packed.data)
    (tmp_path / "model" / "model.safetensors").unlink()  # or this node lacks them
    with pytest.raises(ConfigError, match="safetensors weights missing"):
        unpack_rank_settings(packed.data)


def test_a_gguf_of_other_bytes_is_refused_on_the_rank() -> None:
    source = packaged_gguf()
    record = unpack_record(RankSettingsRecord, pack_rank_settings(settings(source)).data)
    other = record._replace(source=record.source._replace(digest="0" * 64))
    with pytest.raises(WeightsChangedError, match="not the ones the driver hashed"):
        unpack_rank_settings(pack_record(other))


def test_what_is_no_record_is_refused() -> None:
    packed = pack_rank_settings(settings(TinyWeights()))
    with pytest.raises(MessageError, match="RankSettingsRecord"):
        unpack_rank_settings(b"\x93\x01\x02\x03")
    data = msgpack.unpackb(packed.data)
    data["source"]["kind"] = "pickle"
    with pytest.raises(MessageError, match="not one of"):
        unpack_rank_settings(msgpack.packb(data))
    data = msgpack.unpackb(packed.data)
    data["config"]["knobs"]["page_size"] = 3
    with pytest.raises(ConfigError, match="power of two"):
        unpack_rank_settings(msgpack.packb(data))
    with pytest.raises(ConfigError, match="no weight source a rank can rebuild"):
        pack_rank_settings(settings(object()))


def test_the_cache_config_record_is_its_validated_dict() -> None:
    record = HiCacheConfigRecord.of(CONFIG)
    assert record.knobs["write_policy"] == "write_back" and "storage_options" not in record.knobs
    assert record.storage_options == CONFIG.storage_options.to_dict()
    assert unpack_record(HiCacheConfigRecord, pack_record(record)).config() == CONFIG
