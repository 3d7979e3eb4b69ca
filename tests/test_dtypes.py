"""The dtype choice: auto resolves per device to what the hardware computes in."""
import pytest
import torch

from kvtier import dtypes
from kvtier.dtypes import DType, resolve
from kvtier.errors import ConfigError
from kvtier.frontend.settings import ServeSettings


def test_auto_is_bf16_only_where_the_device_computes_in_it(monkeypatch):
    monkeypatch.setattr(dtypes, "native_bf16", lambda device: False)
    assert resolve(DType.AUTO, "cpu") is torch.float32
    monkeypatch.setattr(dtypes, "native_bf16", lambda device: True)
    assert resolve("auto", "cpu") is torch.bfloat16


def test_cpu_without_avx512_bf16_or_amx_has_no_native_bf16(monkeypatch):
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert not dtypes.native_bf16("cpu")
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert dtypes.native_bf16(torch.device("cpu"))


def test_explicit_choices_and_torch_dtypes_are_kept():
    assert resolve("bf16", "cpu") is torch.bfloat16
    assert resolve(DType.FP32, "cpu") is torch.float32
    assert resolve(torch.float16, "cpu") is torch.float16
    assert dtypes.name(torch.bfloat16) == "bf16" and dtypes.name(torch.float32) == "fp32"
    assert dtypes.name(torch.float16) == "float16"


def test_a_bad_choice_names_the_choices():
    with pytest.raises(ConfigError, match="auto, bf16, fp32"):
        resolve("fp8", "cpu")


def test_serving_defaults_to_auto():
    assert ServeSettings().dtype is DType.AUTO
    assert ServeSettings(dtype="FP32").dtype is DType.FP32
