"""The fp8 KV cache (kv_cache_dtype: fp8_e4m3): the pool holds float8_e4m3fn, one byte a value, so it holds
twice the tokens of a bf16 pool (four times float32's) in the same memory. Values are stored as x / scale
saturated to e4m3's +-448 and read back as x.float() * scale, then attended in the model's own dtype: only the
pool changes. Used by the SDPA path (attention/sdpa_backend.py: Llama's K and V), the MLA path (mla.py,
attention/mla_sdpa.py: the latent and rope key) and the Triton kernels (Llama's decode and prefill kernels and
fused store, the MLA decode kernel), which cast what they load to the model's dtype: they take the scale to be
1.0. FlashInfer's FA3 module does not read fp8: check_backend refuses it, and auto does not take it.

The scale is static and 1.0 for every layer's K and V (and MLA's latent), as vLLM does without calibration:
e4m3's relative step (2^-4 at worst, 3 mantissa bits) is the same anywhere in its normal range [2^-6, 448],
and the values stored here sit well inside it (RMS-normed latents, rotated keys and values of O(1) to O(10));
a calibrated per-layer scale would only move that range, at the price of a calibration pass we do not have.

Attention reads what the pool holds, also for the chunk's own tokens (round_trip): a prompt prefilled cold,
in chunks, or over a cached prefix attends to the same quantised values, so warm == cold stays exact.
"""

from __future__ import annotations

from typing import Literal

import torch

KvCacheDtype = Literal["auto", "fp8_e4m3"]
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448: larger magnitudes saturate (e4m3fn has no infinity)
KV_SCALE = 1.0  # per layer, for K, V and MLA's latent alike (see above)


def pool_dtype(setting: KvCacheDtype, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the paged pool: the model's own (auto) or float8_e4m3fn."""
    if setting == "auto":
        return model_dtype
    if setting == "fp8_e4m3":
        return FP8
    raise ValueError(f"kv_cache_dtype must be auto or fp8_e4m3, got {setting!r}")


def check_backend(setting: str, kv_dtype: torch.dtype) -> str:
    """The attention_backend setting an fp8 pool runs: fa4 and flashinfer are refused by name, before anything
    asks for CUDA, since their kernels read 16-bit K/V only; auto, triton and sdpa stand (auto then takes the Triton
    kernels where they run, else SDPA: selector.choose_backend)."""
    if kv_dtype != FP8:
        return setting
    if setting in ("fa4", "flashinfer"):
        raise RuntimeError(
            f"attention_backend: {setting} does not read an fp8 KV cache; kv_cache_dtype fp8_e4m3 runs "
            "attention_backend auto, triton or sdpa"
        )
    assert KV_SCALE == 1.0, "the Triton kernels read an fp8 pool's values unscaled"
    return setting


def is_quantised(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def quantize(x: torch.Tensor, scale: float = KV_SCALE) -> torch.Tensor:
    """x / scale as e4m3, saturated at +-448 (a cast alone may give NaN out of range on some devices)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize(x: torch.Tensor, dtype: torch.dtype, scale: float = KV_SCALE) -> torch.Tensor:
    """What the pool holds, in the compute dtype: x.float() * scale (a pool in the model's dtype unchanged)."""
    if x.dtype != FP8:
        return x
    return (x.float() * scale).to(dtype)


def round_trip(x: torch.Tensor, cache: torch.Tensor, scale: float = KV_SCALE) -> torch.Tensor:
    """x as attention reads it back from `cache`: quantised and dequantised when the pool is fp8, else x."""
    if cache.dtype != FP8:
        return x
    return dequantize(quantize(x, scale), x.dtype, scale)


def store(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor, x: torch.Tensor) -> None:
    """cache[blocks, offsets] = x, quantised when the pool is fp8."""
    cache[blocks, offsets] = quantize(x) if cache.dtype == FP8 else x
