"""A CUDA attention backend whose prefill chunks, cold and warm, are flash-attn 4's SM90 forward (FA3's Hopper
algorithm written in the CuTe DSL: the `flash-attn-4` package), reading K/V in place from the block-major pool.

Decode rows go to our split-K Triton decode kernel (graph-safe), as in TritonAttention. Every prefill chunk of
a step goes to one FA4 launch per layer: q rows of the chunks (adjacent in the batch, after the decodes) as a
varlen batch (cu_seqlens_q), each chunk's context length (seqused_k) and its block-table row as the page table
([chunks, pages]). FA4 takes the page stride from the layer view ([blocks, 16, Hkv, D], a block holding every
layer: 2 MB apart in the llama-8b shape), so nothing is gathered. Its causal mask is aligned bottom-right when a
chunk is shorter than its context, which is our chunk-over-prefix mask; a cold chunk is just a chunk whose
context is itself (its K/V are in the pool: the fused rotary kernel stored them before attention).

On the H200 (one llama-8b layer, bf16) it takes 3-9% less time than FlashInfer's FA3 and about a third less than
our Triton kernel on warm chunks, and is level with flash SDPA on cold ones; pack_gqa off is faster than on for
these shapes. The pool's layout does not matter there: a one-layer pool, blocks in order, or 32/64-token blocks
moved FA3 and FA4 by 2% or less.

FA4 compiles each kernel variant at first use (5-7 s each, CuTe DSL; no nvcc). warm_up() compiles the variants
a step can need at start-up (the engine calls it), on a scratch pool of its own laid out as the engine's; FA4
keeps them on disk for the next start (FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED, which usable() turns on unless
set; FLASH_ATTENTION_CUTE_DSL_CACHE_DIR, default /tmp/<user>/flash_attention_cute_dsl_cache).

flash_attn is imported here only, lazily: the CPU path and CI never import it. Refused over an fp8 pool (its
SM90 kernel reads 16-bit K/V; kv_quant.check_backend).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import logging
import os
import time
from dataclasses import dataclass

import torch

from rank_worker.model.attention.backend import AttentionBackend
from rank_worker.model.attention.triton_backend import attend_decodes
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice, require_adjacent

log = logging.getLogger(__name__)

# (new tokens, context) of the chunks of the steps warm_up runs, which between them take every kernel variant
# a step needs: a short chunk over a short prefix, two chunks (one cold), a chunk past one q tile over a long
# prefix, then steps of cold chunks alone (their own K/V, not the pool): a short one and a long one.
WARM_UP_STEPS: list[list[tuple[int, int]]] = [[(2, 18)], [(16, 16), (3, 20)], [(300, 2300)], [(16, 16)], [(1000, 1000)]]


@dataclass
class Fa4Plan:
    span: tuple[int, int]  # first and end row of the launch (the step's prefill rows)
    cu_q: torch.Tensor  # [chunks + 1] int32: each chunk's first row, from span[0]
    used_k: torch.Tensor  # [chunks] int32: each chunk's context length
    pages: torch.Tensor  # [chunks, table width] int32: each chunk's block-table row
    max_q: int
    cold: bool  # every chunk is its whole context: attention reads the chunks' own K/V, not the pool


class Fa4Attention(AttentionBackend):
    name = "fa4"
    fused_store = True
    graph_safe = True  # decode-only steps (the graphed ones) run the Triton decode kernel alone
    # A cold prompt in one step reads its own K/V rows (TMA) for all of its attention; in 32K chunks every chunk
    # past the first reads the ones before through 16-token pages (cp.async): the whole 100K prompt's attention,
    # one llama-8b layer on the H200, about 12% less time in one piece.
    solo_prefill_tokens = 131072

    def __init__(self, dtype: torch.dtype, group: int) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend fa4: FA4 takes bf16/fp16, not {dtype}")
        self.dtype = dtype
        self.group = group
        # Reused every step (pinning memory costs more than the copy); two in turn, since a pipelined step's
        # plan may fill one while the copy from the other is still queued.
        self._host = [torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int32)]
        self._turn = 0

    def plan(self, batch: ForwardBatch) -> None:
        if not batch.prefills:
            batch.attention = None
            return
        pieces = sorted(batch.prefills, key=lambda p: p.token_start)
        require_adjacent(pieces, "fa4 backend")
        start = pieces[0].token_start
        qo = list(itertools.accumulate((p.num_new for p in pieces), initial=0))
        values = qo + [p.context_len for p in pieces] + [p.table_row for p in pieces]
        device = self._upload(values, batch.block_tables.device)
        n = len(pieces)
        rows = device[2 * n + 1 :].long()
        batch.attention = Fa4Plan(
            span=(start, start + qo[-1]),
            cu_q=device[: n + 1],
            used_k=device[n + 1 : 2 * n + 1],
            pages=batch.block_tables.index_select(0, rows),
            max_q=max(p.num_new for p in pieces),
            cold=all(p.context_len == p.num_new for p in pieces),
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
            assert isinstance(plan, Fa4Plan)
            run_fa4(q, k_cache, v_cache, plan, scale, out, own_kv=(k, v))
        return out

    def warm_up(self, kv_cache: torch.Tensor) -> float:
        """Compile the kernel variants of WARM_UP_STEPS now, over a scratch pool laid out as kv_cache, the
        engine's ([blocks, layers, 2, block, Hkv, D]: a layer's pages as far apart), read through one layer's
        views. Returns the seconds it took."""
        started = time.perf_counter()
        _, layers, _, block_size, kv_heads, head_dim = kv_cache.shape
        device = kv_cache.device
        blocks = max(sum(-(-ctx // block_size) for _, ctx in step) for step in WARM_UP_STEPS) + 1
        pool = torch.zeros(blocks, *kv_cache.shape[1:], dtype=self.dtype, device=device)
        layer = pool[:, layers - 1]
        for chunks in WARM_UP_STEPS:
            width = max(-(-ctx // block_size) for _, ctx in chunks)
            table = torch.zeros(len(chunks), width, dtype=torch.int32, device=device)
            pieces, used, cursor = [], 1, 0
            for row, (new, ctx) in enumerate(chunks):
                count = -(-ctx // block_size)
                table[row, :count] = torch.arange(used, used + count, dtype=torch.int32)
                used += count
                pieces.append(PrefillSlice(cursor, new, ctx, row))
                cursor += new
            zeros = torch.zeros(cursor, dtype=torch.long, device=device)
            batch = ForwardBatch(zeros, zeros, zeros, zeros, zeros[:0], table, prefills=pieces)
            self.plan(batch)
            q = torch.zeros(cursor, kv_heads * self.group, head_dim, dtype=self.dtype, device=device)
            kv = q[:, :kv_heads]
            self.attend(q, kv, kv, layer[:, 0], layer[:, 1], batch, head_dim**-0.5)
        torch.cuda.synchronize(device)
        del pool
        return time.perf_counter() - started

    def _upload(self, values: list[int], device: torch.device) -> torch.Tensor:
        self._turn ^= 1
        host = self._host[self._turn]
        if host.numel() < len(values):
            host = torch.empty(max(len(values), 2 * host.numel(), 1024), dtype=torch.int32)
            host = host.pin_memory() if device.type == "cuda" else host
            self._host[self._turn] = host
        view = host[: len(values)]
        view.numpy()[:] = values
        return view.to(device, non_blocking=True)


def run_fa4(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: Fa4Plan,
    scale: float,
    out: torch.Tensor,
    own_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    **options: object,
) -> None:
    """One FA4 launch over the plan's chunks: q rows span, K/V read through the page table, into out. options:
    FA4's own (bench/probes/fa4_probe.py times pack_gqa on and off through them).

    own_kv: the step's rotated K/V rows ([T, Hkv, D], views of the projection), which a step of cold chunks reads
    instead of the pool. Through a page table of 16-token pages FA4 loads K/V by cp.async (TMA needs a page of
    its 128-token tile); contiguous rows go by TMA, about 12% less time for a cold 32K chunk of the llama-8b shape
    on the H200."""
    from flash_attn.cute.interface import _flash_attn_fwd  # lazily: only CUDA prefill steps get here

    start, end = plan.span
    if plan.cold and own_kv is not None:
        k, v = own_kv[0][start:end], own_kv[1][start:end]
        reads: dict[str, object] = {"cu_seqlens_k": plan.cu_q, "max_seqlen_k": plan.max_q}
    else:
        k, v = k_cache, v_cache
        reads = {"seqused_k": plan.used_k, "page_table": plan.pages}
    _flash_attn_fwd(
        q[start:end],
        k,
        v,
        cu_seqlens_q=plan.cu_q,
        max_seqlen_q=plan.max_q,
        softmax_scale=scale,
        causal=True,
        out=out[start:end],
        **reads,
        **({"pack_gqa": False} | options),
    )


@functools.cache
def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether flash-attn 4 is installed and this is an SM90 GPU (its Hopper forward; Blackwell has other FA4
    kernels we have not measured) with 16-bit K/V. Once per process: the import takes seconds."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if importlib.util.find_spec("cutlass") is None:
        return False
    if torch.cuda.get_device_capability(device)[0] != 9:
        return False
    # Compiled kernels kept on disk for the next start (FA4 keeps them in memory only unless told), where the
    # operator has not chosen otherwise.
    os.environ.setdefault("FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED", "1")
    try:
        from flash_attn.cute.interface import _flash_attn_fwd  # noqa: F401
    except Exception as exc:  # installed but broken (a missing CUDA library, a wrong cutlass-dsl): not used
        log.warning("flash-attn 4 is installed but does not import (%s): not using it", exc)
        return False
    return True
