"""The model and KV dtype a user picks (`auto`, `bf16`, `fp32`) and what it becomes on a device.

`auto` is bf16 where the hardware computes in bf16 (CUDA GPUs that support it, CPUs with
AVX512-BF16 or AMX) and fp32 elsewhere: on a CPU without them, torch emulates bf16 matrix
products and a SmolLM2 prefill runs about 4x slower than in fp32. The choice is resolved
where the model is built, for the device it is built on, so a driver without a GPU does not
pick the dtype of ranks that have one. The KV dtype is part of a cache namespace's layout
fingerprint: instances that resolved differently never share L3 pages.

torch is imported only by the functions, so CLI modules can name the choices cheaply.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.policies import _Choice

if TYPE_CHECKING:
    import torch


class DType(_Choice):
    AUTO = "auto"
    BF16 = "bf16"
    FP32 = "fp32"


def native_bf16(device: "torch.device | str") -> bool:
    """Whether `device` computes bf16 matrix products in hardware."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if device.type == "cpu":
        checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
        return any(getattr(torch.cpu, check, lambda: False)() for check in checks)
    return False


def resolve(choice: "DType | str | torch.dtype", device: "torch.device | str") -> "torch.dtype":
    """The torch dtype of `choice` on `device` (a torch dtype is returned as given)."""
    import torch

    if isinstance(choice, torch.dtype):
        return choice
    choice = DType.parse(choice, "dtype")
    if choice is DType.AUTO:
        choice = DType.BF16 if native_bf16(device) else DType.FP32
    return torch.bfloat16 if choice is DType.BF16 else torch.float32


def name(dtype: "torch.dtype") -> str:
    """The CLI spelling of a resolved dtype ("bf16", "fp32"; else torch's name without
    "torch."): reports and calibration files use it."""
    import torch

    spellings = {torch.bfloat16: DType.BF16.value, torch.float32: DType.FP32.value}
    return spellings.get(dtype, str(dtype).removeprefix("torch."))


def resolve_here(choice: "DType | str | torch.dtype") -> "torch.dtype":
    """`resolve` for this process's default device (CUDA when present, else the CPU: the
    device kvtier.tiers.device_pool.default_device picks)."""
    import torch

    return resolve(choice, "cuda" if torch.cuda.is_available() else "cpu")
