"""The CUDA attention backend: Triton kernels that read K/V in place from the block-major pool.

Decode rows go to the split-K decode kernel (one launch for all of them, graph-safe: its grid depends on the
batch size alone); every prefill chunk over a cached prefix goes to one launch of the paged prefill kernel.
Neither gathers a sequence's blocks. K/V of the step are stored by the fused rotary kernel
(fused_ops.rope_and_store) before attention, so the kernels read the chunk's own keys from the pool too. An
fp8 pool (kv_quant.py) is stored quantised by that kernel and read by both as its values: its scale is 1.0.

A chunk with nothing cached before it attends only to its own K/V, which the step holds contiguously: it
goes to PyTorch's flash SDPA, measured faster there than our kernel (H200, 8K tokens, one llama-8b layer:
1.02 ms against 1.59 ms; with a 32K prefix ours is faster: 12.7 ms against 14.5 ms gathered + SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rank_worker.model.attention import kv_quant
from rank_worker.model.attention.backend import AttentionBackend
from rank_worker.model.attention.decode_kernel import paged_decode_attention
from rank_worker.model.attention.prefill_kernel import PACK_GQA, paged_prefill_attention, prefill_tiles, tile_tokens
from rank_worker.model.attention.sdpa_backend import causal_sdpa
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice


@dataclass
class TritonPlan:
    cold: list[tuple[int, int]]  # (first token, new tokens) of chunks with nothing cached before them
    tile_piece: torch.Tensor  # [tiles] int32
    tile_m: torch.Tensor  # [tiles] int32
    piece_info: torch.Tensor  # [pieces, 4] int32: table row, first token, new tokens, context


class TritonAttention(AttentionBackend):
    name = "triton"
    fused_store = True
    graph_safe = True

    def __init__(self, dtype: torch.dtype, group: int, pack_gqa: bool = PACK_GQA) -> None:
        self.pack_gqa = pack_gqa
        # Flash SDPA takes 16-bit inputs only; float32 SDPA falls to the math kernel, whose n x n scores do
        # not fit (a 32K-token chunk wanted 128 GiB on the H200): float32 cold chunks run our kernel too.
        self.cold_to_sdpa = dtype in (torch.bfloat16, torch.float16)
        self.tile_tokens = tile_tokens(dtype, group, pack_gqa)  # the prefill kernel's new tokens per program
        # Reused every step (pinning memory costs more than the copy): a step has finished reading it by the
        # time the next one writes it, since sampling waits for the step's results.
        self._host = torch.empty(0, dtype=torch.int32)

    def plan(self, batch: ForwardBatch) -> None:
        """Lay the step's prefill chunks out as kernel tiles: one small host->device copy per step."""
        if not batch.prefills:
            batch.attention = None
            return

        def is_cold(piece: PrefillSlice) -> bool:
            return self.cold_to_sdpa and piece.context_len == piece.num_new

        cold = [(p.token_start, p.num_new) for p in batch.prefills if is_cold(p)]
        pieces = [(p.table_row, p.token_start, p.num_new, p.context_len) for p in batch.prefills if not is_cold(p)]
        tile_piece, tile_m = prefill_tiles(pieces, self.tile_tokens)
        flat = [value for piece in pieces for value in piece] + tile_piece + tile_m
        device = self._upload(flat, batch.input_ids.device)
        count, tiles = len(pieces), len(tile_piece)
        batch.attention = TritonPlan(
            cold=cold,
            tile_piece=device[4 * count : 4 * count + tiles],
            tile_m=device[4 * count + tiles :],
            piece_info=device[: 4 * count].view(count, 4),
        )

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
        out = torch.empty_like(q)
        attend_decodes(q, k_cache, v_cache, batch, scale, out)
        plan = batch.attention
        if plan is not None:
            assert isinstance(plan, TritonPlan)
            paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                plan.tile_piece,
                plan.tile_m,
                plan.piece_info,
                scale,
                out,
                self.pack_gqa,
            )
            attend_cold(q, k, v, k_cache, v_cache, plan.cold, scale, out)
        return out

    def _upload(self, values: list[int], device: torch.device) -> torch.Tensor:
        if self._host.numel() < len(values):
            self._host = torch.empty(max(len(values), 2 * self._host.numel(), 1024), dtype=torch.int32).pin_memory()
        host = self._host[: len(values)]
        host.numpy()[:] = values
        return host.to(device, non_blocking=True)


def attend_decodes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch, scale: float, out: torch.Tensor
) -> None:
    """The step's decode rows (its first num_decodes tokens) by the split-K kernel, into out."""
    n = batch.num_decodes
    if n:
        assert batch.decode_rows is not None and batch.decode_lens is not None
        paged_decode_attention(
            q[:n], k_cache, v_cache, batch.block_tables, batch.decode_rows, batch.decode_lens, scale, out=out[:n]
        )


def attend_cold(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cold: list[tuple[int, int]],
    scale: float,
    out: torch.Tensor,
) -> None:
    """Chunks with nothing cached before them ((first token, new tokens) each) by flash SDPA over their own K/V,
    as the pool holds them (an fp8 pool: quantised and back, kv_quant.round_trip, as the kernels read them)."""
    for start, count in cold:
        rows = slice(start, start + count)
        keys, values = kv_quant.round_trip(k[rows], k_cache), kv_quant.round_trip(v[rows], v_cache)
        out[rows] = causal_sdpa(q[rows], keys, values, scale)
