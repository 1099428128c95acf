"""The attention backend interface: one object per backend that builds its metadata once per step (plan) and
runs decode, plain prefill and prefill over a cached prefix for each layer (attend), over the paged pool
[num_blocks, num_layers, 2, block_size, kv_heads, head_dim].

Four backends: SdpaAttention (PyTorch SDPA over gathered blocks: the CPU path, exact against transformers in
float32), TritonAttention (CUDA: our kernels, reading K/V in place through the block table), Fa4Attention
(CUDA SM90: flash-attn 4's paged forward for every prefill chunk, ours for decode; the kvserve[cuda] extra) and
FlashInferAttention (CUDA: FlashInfer's FA3 paged kernel for prefill over a cached prefix, ours for decode;
needs the kvserve[cuda] extra with FlashInfer's prebuilt modules). Over a long cached prefix FlashInfer's prefill
is faster than ours and ours than gather + SDPA, for one layer and for a whole warm prefill alike (H200, llama-8b).

Which one a rank runs is selector.py's choice. DeepSeek's MLA has backends of its own over its latent pool
(mla_sdpa.py; mla_triton.py on CUDA), chosen by deepseek.choose_attention.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Literal

import torch

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
    # Whether prefill over a cached prefix allocates per context token (MLA expands its latents into per-head K/V),
    # so the pool's sizing probe must run a chunk over a prefix, not only a cold one (factory._profile_peak_bytes)
    prefix_expands: bool = False
    # The most context tokens such a backend expands at a time (mla_windows.py); None: a chunk's whole context.
    # The engine sets its longest step, the one its pool's sizing probe runs. Backends that read K/V in place
    # ignore it.
    context_window_tokens: int | None = None

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
