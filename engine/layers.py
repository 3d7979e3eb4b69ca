"""The building blocks of a decoder layer besides attention: RMSNorm, rotary embedding, gated MLP.

Numerics follow HF transformers' Llama and Gemma-3 (norm in float32, cos/sin in float32 cast
to the activation dtype), so logits agree with them closely in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvtier.engine.model_config import Activation, NormStyle
from kvtier.engine.parallel import TensorParallel
from kvtier.errors import CacheUsageError


def empty_weight(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An inference-only parameter, filled by the owner's `load`."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """PLAIN: w * x (x cast back first, as Llama); OFFSET: x * (1 + w) in float32 (Gemma)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device,
                 style: NormStyle = NormStyle.PLAIN) -> None:
        super().__init__()
        self.eps, self.style = eps, style
        self.weight = empty_weight(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.style is NormStyle.OFFSET:
            return (x * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """NeoX-style rotary embedding (HF `rotate_half`) with a cos/sin table per position."""

    def __init__(self, head_dim: int, theta: float, max_position: int, device: torch.device) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device)
                                   .float() / head_dim)
        freqs = torch.outer(torch.arange(max_position, device=device).float(), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.max_position = max_position
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def table(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (T, 1, head_dim), for the given positions."""
        if positions.numel() and int(positions.max()) >= self.max_position:
            raise CacheUsageError(f"position {int(positions.max())} is beyond the model's "
                                  f"{self.max_position} positions; shorten the request")
        return self.cos[positions, None].to(dtype), self.sin[positions, None].to(dtype)

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x (T, heads, head_dim)."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin


_ACTIVATIONS = {Activation.SILU: F.silu,
                Activation.GELU_TANH: lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """Gated: down(act(gate(x)) * up(x)), act SiLU (SwiGLU) or GELU-tanh (Gemma's GeGLU);
    gate/up fused and column-parallel, down row-parallel."""

    def __init__(self, hidden: int, intermediate: int, tp: TensorParallel, dtype: torch.dtype,
                 device: torch.device, activation: Activation = Activation.SILU) -> None:
        super().__init__()
        self.tp = tp
        self.act = _ACTIVATIONS[activation]
        self.local = intermediate // tp.size
        self.gate_up = empty_weight(2 * self.local, hidden, dtype=dtype, device=device)
        self.down = empty_weight(hidden, self.local, dtype=dtype, device=device)

    def load(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Take this rank's shard of full HF weights."""
        self.gate_up.copy_(torch.cat([self.tp.rows(gate), self.tp.rows(up)]))
        self.down.copy_(self.tp.cols(down))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.gate_up).split(self.local, dim=-1)
        return self.tp.all_reduce(F.linear(self.act(gate) * up, self.down))
