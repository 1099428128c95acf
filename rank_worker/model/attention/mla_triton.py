"""The CUDA MLA backend: decode rows by the Triton kernel reading each row's latents in place through the block
table (mla_decode_kernel.py), prefill chunks by mla_sdpa.py's expanded-latent SDPA, as on the CPU.

A decode-only step runs the W_UK fold, the kernel and the W_UV product: fixed shapes given the batch size, no
host sync, nothing gathered, so it can be recorded in a CUDA graph (the MoE's routed experts switch to their
sync-free form while one is recorded: moe.py).
"""

from __future__ import annotations

import torch

from rank_worker.model.attention.mla_decode_kernel import mla_decode_attention
from rank_worker.model.attention.mla_sdpa import MlaSdpaAttention
from rank_worker.model.forward_batch import ForwardBatch


class MlaTritonAttention(MlaSdpaAttention):
    name = "mla_triton"
    graph_safe = True

    def plan(self, batch: ForwardBatch) -> None:
        batch.attention = None  # the kernel reads the persistent block table through decode_rows; prefills too

    def decode_latent(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        assert batch.decode_rows is not None and batch.decode_lens is not None
        return mla_decode_attention(
            q_lat, q_pe, latent_cache, batch.block_tables, batch.decode_rows, batch.decode_lens, scale
        )
