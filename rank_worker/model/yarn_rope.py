"""DeepSeek's rotary embedding of the qk_rope_head_dim part of q and k: plain or YaRN-scaled frequencies, the
YaRN attention factor on cos/sin, and the softmax-scale correction (mscale_all_dim) that goes with it.

Rotated vectors come out in the half-split layout [x1*cos - x2*sin, x2*cos + x1*sin] whether the pairs
(x1, x2) are interleaved (0,1), (2,3)... (DeepSeek's checkpoints) or the two halves (rope_interleave: false);
q and k share the layout, so their dot products are those of transformers' rotation.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2], attention factor on cos/sin), in float32 as transformers computes them."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if not scaling or (scaling.get("rope_type") or scaling.get("type")) in (None, "default"):
        return 1.0 / pos_freqs, 1.0
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        # The dimension whose wavelength fits `rotations` turns in the original context.
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a ramp of zero width
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # short wavelengths keep their frequency, long ones are slowed by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek's long-context fix)."""
    scale = qk_head_dim**-0.5
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        mscale_all_dim = scaling.get("mscale_all_dim") or 0
        if mscale_all_dim:
            mscale = yarn_mscale(float(scaling["factor"]), float(mscale_all_dim))
            scale = scale * mscale * mscale
    return scale


class DeepseekRotary(torch.nn.Module):
    def __init__(
        self, dim: int, theta: float, scaling: dict[str, Any] | None, interleaved: bool, max_positions: int
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_frequencies(dim, theta, scaling)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        self.interleaved = interleaved
        self.register_buffer("cos_cache", freqs.cos() * attention_factor, persistent=False)  # [P, dim/2]
        self.register_buffer("sin_cache", freqs.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, dim] (any heads); positions [T]. Returns the rotated x, half-split layout."""
        cos = self.cos_cache[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(x.dtype).unsqueeze(1)
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
