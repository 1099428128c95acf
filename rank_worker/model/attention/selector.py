"""Which attention backend a Llama-family rank runs (choose_backend), apart from the interface (backend.py) that
every backend implements, so the interface imports none of them."""

from __future__ import annotations

import torch

from rank_worker.model.attention import decode_kernel, kv_quant
from rank_worker.model.attention.backend import AttentionBackend, BackendName
from rank_worker.model.attention.sdpa_backend import SdpaAttention


def choose_backend(
    setting: BackendName,
    device: torch.device,
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    group: int,
    kv_dtype: torch.dtype | None = None,
) -> AttentionBackend:
    """group: query heads per kv head; kv_dtype: the pool's (None: dtype). auto, over a 16-bit pool: flash-attn
    4 on an SM90 GPU where it is installed (fa4_backend.usable; measured the fastest there), else FlashInfer
    where it runs without compiling (its prebuilt modules installed: flashinfer_backend.usable); then, fp8 pools
    included (neither reads fp8), the Triton kernels wherever they run (CUDA, Triton, a power-of-two
    head_dim >= 16), else SDPA."""
    # The CUDA backends' modules are imported once chosen: the CPU path never loads them.
    fits = device.type == "cuda" and decode_kernel.available() and head_dim >= 16 and head_dim & (head_dim - 1) == 0
    if setting in ("triton", "fa4", "flashinfer") and not fits:
        raise RuntimeError(f"attention_backend: {setting} needs CUDA, Triton and a power-of-two head_dim >= 16")
    fp8_pool = kv_dtype == kv_quant.FP8  # kv_quant.check_backend refused fa4 and flashinfer by name
    if setting in ("fa4", "auto") and fits and not fp8_pool:
        from rank_worker.model.attention import fa4_backend

        if setting == "fa4" or fa4_backend.usable(device, dtype):
            return fa4_backend.Fa4Attention(dtype, group)
    if setting in ("flashinfer", "auto") and fits and not fp8_pool:
        from rank_worker.model.attention import flashinfer_backend

        if setting == "flashinfer" or flashinfer_backend.usable(device, dtype, heads, heads // group, head_dim):
            return flashinfer_backend.FlashInferAttention(dtype, group)
    if fits and setting != "sdpa":
        from rank_worker.model.attention.triton_backend import TritonAttention

        return TritonAttention(dtype, group)
    return SdpaAttention()
