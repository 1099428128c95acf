"""The attention backend interface: one object per backend that builds its metadata once per step (plan) and
runs decode, plain prefill and prefill over a cached prefix for each layer (attend), over the paged pool
[num_blocks, num_layers, 2, block_size, kv_heads, head_dim].

Four backends: SdpaAttention (PyTorch SDPA over gathered blocks: the CPU path, exact against transformers in
float32), TritonAttention (CUDA: our kernels, reading K/V in place through the block table), Fa4Attention
(CUDA SM90: flash-attn 4's paged forward for every prefill chunk, ours for decode; the kvserve[cuda] extra) and
FlashInferAttention (CUDA: FlashInfer's FA3 paged kernel for prefill over a cached prefix, ours for decode;
needs the kvserve[cuda] extra with FlashInfer's prebuilt modules). Measured on the H200 (one llama-8b layer,
8K new over a 32K prefix): FlashInfer 9.2 ms, ours 11.3 ms, gather + SDPA 14.4 ms
(bench/results/flashinfer-probe-h200.json); whole engines, 8K over 32K: 0.487 s against 0.557 s, 4K over
100K: 0.515 s against 0.669 s (bench/results/engine-flashinfer-h200.json).

DeepSeek's MLA has backends of its own over its latent pool (mla_sdpa.py; mla_triton.py on CUDA), chosen by
deepseek.choose_attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch

from rank_worker.model.attention import kv_quant
from rank_worker.model.forward_batch import ForwardBatch

BackendName = Literal["auto", "triton", "fa4", "flashinfer", "sdpa"]


class AttentionBackend(ABC):
    name: str
    # Whether a step's K/V are stored (and q/k rotated) by the fused rotary kernel before attend is called.
    fused_store: bool = False
    # Whether attend may run inside a CUDA graph (fixed shapes given the batch size, no host syncs).
    graph_safe: bool = False
    # The longest prompt with nothing cached that, on a rank with nothing else running, this backend would rather
    # prefill in one step than in max_num_batched_tokens chunks (the engine's solo_prefill_tokens when unset);
    # 0: chunks. A backend sets it where a whole cold prompt reads K/V faster than chunks over their pages.
    solo_prefill_tokens: int = 0

    @abstractmethod
    def plan(self, batch: ForwardBatch) -> None:
        """Build the step's metadata into batch.attention (once per step, before the layers run)."""

    @abstractmethod
    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        batch: ForwardBatch,
        scale: float,
    ) -> torch.Tensor:
        """q [T, Hq, D]; k, v this step's [T, Hkv, D], already in the pool; k_cache/v_cache one layer's
        [blocks, block_size, Hkv, D] views. Returns [T, Hq, D]."""

    def warm_up(self, kv_cache: torch.Tensor) -> float:
        """Compile at start-up what attend would compile at first use (the engine's pool given for its layout);
        returns the seconds it took. Most backends need nothing beyond the runner's warm-up step."""
        return 0.0


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
    from rank_worker.model.attention import decode_kernel
    from rank_worker.model.attention.sdpa_backend import SdpaAttention

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
