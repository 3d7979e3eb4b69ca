"""A weight source as it crosses to another process: a small record (its kind, its path and
the digest of the weights the driver saw, or a random model's own parameters) from which the
rank builds the source again. A rank never gets a pickled source object.

A source given by path (a model directory, a GGUF file) may differ on the rank's node, or
change between the driver's look and the rank's: the rank hashes what it finds and refuses
weights whose digest is not the driver's (`WeightsChangedError`), before it builds a model
whose pages would be keyed by the wrong identity.
"""
from __future__ import annotations

from typing import NamedTuple

from kvtier.engine.gemma3_package import Gemma3Weights
from kvtier.engine.gguf_file import GGUFFile
from kvtier.engine.hf_dir import HFModelDir
from kvtier.engine.model_config import ModelConfig
from kvtier.engine.weight_sources import SmolLM2Weights, TinyWeights, WeightSource
from kvtier.errors import ConfigError
from kvtier.policies import _Choice


class WeightSourceKind(_Choice):
    """Which weight source a record names."""

    TINY = "tiny"  # TinyWeights: random weights from a seed and a model config
    SMOLLM2 = "smollm2"  # SmolLM2Weights: the packaged model
    GEMMA3 = "gemma3"  # Gemma3Weights: the packaged model (checked against its SHA-256)
    HF_DIR = "hf_dir"  # HFModelDir: a Hugging Face model directory, by path and digest
    GGUF = "gguf"  # GGUFFile: a GGUF file, by path and digest


class WeightsChangedError(ConfigError):
    """The weights at a source's path are not the ones the driver hashed."""


class WeightSourceRecord(NamedTuple):
    """What a rank rebuilds its weight source from (kvtier.messages `pack_record`)."""

    kind: WeightSourceKind
    path: str = ""  # hf_dir, gguf: the directory or file (the same path on every node)
    digest: str = ""  # hf_dir, gguf: the SHA-256 of the weights the driver saw
    cache_dir: str | None = None  # smollm2, gemma3, gguf: where converted files go
    seed: int = 0  # tiny: the random weights' seed
    model_config: ModelConfig | None = None  # tiny: the model's shapes


def source_record(source: WeightSource) -> WeightSourceRecord:
    """The record of `source`; a model directory's weights are hashed here (a GGUF file's
    digest was recorded when it was converted)."""
    if isinstance(source, TinyWeights):
        return WeightSourceRecord(WeightSourceKind.TINY, seed=source.seed,
                                  model_config=source.model_config)
    if isinstance(source, SmolLM2Weights):
        return WeightSourceRecord(WeightSourceKind.SMOLLM2, cache_dir=source.cache_dir)
    if isinstance(source, Gemma3Weights):
        return WeightSourceRecord(WeightSourceKind.GEMMA3, cache_dir=source.cache_dir)
    if isinstance(source, HFModelDir):
        return WeightSourceRecord(WeightSourceKind.HF_DIR, path=source.path,
                                  digest=source.digest())
    if isinstance(source, GGUFFile):
        return WeightSourceRecord(WeightSourceKind.GGUF, path=source.path,
                                  digest=source.digest(), cache_dir=source.cache_dir)
    raise ConfigError(f"{type(source).__name__} is no weight source a rank can rebuild; use "
                      f"one of {', '.join(k.value for k in WeightSourceKind)} "
                      f"(engine/weight_source_record.py)")


def open_source(record: WeightSourceRecord) -> WeightSource:
    """The weight source `record` names, as this process finds it: a path's weights must
    have the driver's digest (`WeightsChangedError` otherwise)."""
    kind = record.kind
    if kind is WeightSourceKind.TINY:
        if record.model_config is None:
            raise ConfigError("a tiny weight source record needs its model_config")
        return TinyWeights(record.seed, record.model_config)
    if kind is WeightSourceKind.SMOLLM2:
        return SmolLM2Weights(record.cache_dir)
    if kind is WeightSourceKind.GEMMA3:
        return Gemma3Weights(record.cache_dir)
    source: HFModelDir | GGUFFile = (HFModelDir(record.path) if kind is WeightSourceKind.HF_DIR
                                     else GGUFFile(record.path, record.cache_dir))
    found = source.digest()
    if found != record.digest:
        raise WeightsChangedError(
            f"{record.path}: these weights (SHA-256 {found[:16]}...) are not the ones the "
            f"driver hashed ({record.digest[:16]}...): the {kind.value} changed since, or "
            f"this node has another copy at that path; give every node the same files and "
            f"start again")
    return source
