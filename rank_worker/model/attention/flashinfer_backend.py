"""A CUDA attention backend whose prefill over a cached prefix is FlashInfer's FA3 (sm90) paged kernel.

Decode rows and cold chunks (nothing cached before them) go where TritonAttention sends them: the split-K
decode kernel (graph-safe) and PyTorch's flash SDPA over the chunk's own K/V. The warm chunks of a step go to
one FlashInfer paged-prefill launch per layer, reading K/V in place from the pool through the blocks of
each chunk's block-table row; FlashInfer's causal mask is aligned bottom-right when q is shorter than kv
(mask: kv_idx <= q_idx + kv_len - q_len), which is our chunk-over-prefix mask.

The layer views k_cache/v_cache ([blocks, 16, Hkv, D], a large stride between blocks) are passed as a
tuple: the FA3 paged kernel takes stride(0) as its page stride (int64 offsets) and stride(1)/(2) as the
token and head strides, so the pool is not copied (flashinfer/data/csrc/batch_prefill_sm90.cu).

Per step, plan() picks the chunks of the launch; the first layer's attend, which knows the block size and
head counts, lays them out (qo_indptr, paged_kv_indptr, last-page lengths on the host, the block indices
gathered from the block-table rows on the device) and runs FlashInfer's plan; the other layers reuse it.
Cold chunks between two warm ones join the FlashInfer launch (their K/V are in the pool already), so the
launch reads one contiguous range of q rows and writes one of out.

flashinfer is imported here only, and lazily: the CPU path and CI never import it. It must find its FA3
module prebuilt (the flashinfer-jit-cache package, or .fi/ on the GPU machine: bench/fi_env.sh): compiling
it takes tens of minutes. attention_backend auto takes this backend only where usable() says that module
loads and runs without compiling.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from rank_worker.model.attention.backend import AttentionBackend
from rank_worker.model.attention.triton_backend import attend_cold, attend_decodes
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice, require_adjacent

log = logging.getLogger(__name__)

# FlashInfer's recommended float workspace (split-KV partial results); FA3's plan keeps its schedule in
# the wrapper's own 8 MB int workspace.
WORKSPACE_BYTES = 128 * 1024 * 1024


@dataclass
class FlashInferPlan:
    cold: list[tuple[int, int]]  # (first token, new tokens) of cold chunks outside the warm span: SDPA
    span: tuple[int, int] | None  # first row and end row of the FlashInfer launch, None if no warm chunk
    launched: list[PrefillSlice]  # the chunks of the launch, adjacent, in token order
    block_tables: torch.Tensor


class FlashInferAttention(AttentionBackend):
    name = "flashinfer"
    fused_store = True
    graph_safe = True  # decode-only steps (the graphed ones) run the Triton decode kernel alone

    def __init__(self, dtype: torch.dtype, group: int) -> None:
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention_backend flashinfer: FA3 takes bf16/fp16, not {dtype}")
        self.dtype = dtype
        self.group = group
        self._wrapper = None  # made at the first warm step, on that step's device
        # The step plan and (Hq, Hkv, D, block size, scale) the wrapper is planned for now: one wrapper
        # serves every step, so a plan it does not hold is planned again rather than run with another's.
        self._holds: tuple[FlashInferPlan, tuple] | None = None

    def plan(self, batch: ForwardBatch) -> None:
        if not batch.prefills:
            batch.attention = None
            return
        pieces = sorted(batch.prefills, key=lambda p: p.token_start)
        warm = [i for i, p in enumerate(pieces) if p.context_len > p.num_new]
        if not warm:
            batch.attention = FlashInferPlan([(p.token_start, p.num_new) for p in pieces], None, [], batch.block_tables)
            return
        first, last = warm[0], warm[-1]
        launched = pieces[first : last + 1]
        require_adjacent(launched, "flashinfer backend")
        outside = pieces[:first] + pieces[last + 1 :]
        cold = [(p.token_start, p.num_new) for p in outside]
        start = launched[0].token_start
        span = (start, launched[-1].token_start + launched[-1].num_new)
        batch.attention = FlashInferPlan(cold, span, launched, batch.block_tables)

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
        if plan is None:
            return out
        assert isinstance(plan, FlashInferPlan)
        if plan.span is not None:
            start, end = plan.span
            wrapper = self._planned(plan, q, k_cache, scale)
            wrapper.run(q[start:end], (k_cache, v_cache), out=out[start:end])
        attend_cold(q, k, v, k_cache, v_cache, plan.cold, scale, out)
        return out

    def _planned(self, plan: FlashInferPlan, q: torch.Tensor, k_cache: torch.Tensor, scale: float):
        """FlashInfer's wrapper, planned for this step (once: the first layer plans, the others reuse it)."""
        block_size = k_cache.shape[1]
        key = (q.shape[1], k_cache.shape[2], q.shape[2], block_size, scale)
        if self._holds is not None and self._holds[0] is plan and self._holds[1] == key:
            return self._wrapper
        if self._wrapper is None:
            import flashinfer  # lazily: only CUDA steps with a warm chunk get here

            workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
            self._wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")
        qo_indptr, kv_indptr, kv_last_page_len, kv_indices = paged_layout(plan.launched, block_size, plan.block_tables)
        # Host tensors for the indptrs: FlashInfer's plan reads them on the host, so passing them there
        # spares it a device->host sync.
        self._wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            num_qo_heads=q.shape[1],
            num_kv_heads=k_cache.shape[2],
            head_dim_qk=q.shape[2],
            page_size=block_size,
            causal=True,
            sm_scale=scale,
            q_data_type=q.dtype,
            kv_data_type=k_cache.dtype,
            o_data_type=q.dtype,
        )
        self._holds = (plan, key)
        return self._wrapper


def paged_layout(
    pieces: list[PrefillSlice], block_size: int, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's paged layout of adjacent chunks: qo_indptr (rows from the first chunk's start),
    paged_kv_indptr and paged_kv_last_page_len (1..block_size) as int32 host tensors, and paged_kv_indices:
    each chunk's first ceil(context / block_size) blocks of its block-table row, gathered on the device."""
    start = pieces[0].token_start
    qo, kv, last = [0], [0], []
    for p in pieces:
        qo.append(p.token_start + p.num_new - start)
        blocks = -(-p.context_len // block_size)
        kv.append(kv[-1] + blocks)
        last.append(p.context_len - (blocks - 1) * block_size)
    indices = torch.cat([block_tables[p.table_row, : kv[i + 1] - kv[i]] for i, p in enumerate(pieces)])
    return (
        torch.tensor(qo, dtype=torch.int32),
        torch.tensor(kv, dtype=torch.int32),
        torch.tensor(last, dtype=torch.int32),
        indices.to(torch.int32),
    )


@functools.cache
def usable(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether FlashInfer is installed with its prebuilt modules and runs a warm chunk of this shape here,
    without compiling anything (FLASHINFER_DISABLE_JIT for the check: a module it lacks fails at once). Once
    per process and shape; the module it loads stays loaded for the engine's steps."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return False
    if importlib.util.find_spec("flashinfer") is None or importlib.util.find_spec("flashinfer_jit_cache") is None:
        return False
    previous = os.environ.get("FLASHINFER_DISABLE_JIT")
    os.environ["FLASHINFER_DISABLE_JIT"] = "1"
    try:
        block = 16
        pool = torch.randn(3, 2, block, kv_heads, head_dim, device=device).to(dtype)
        q = torch.randn(2, heads, head_dim, device=device).to(dtype)
        table = torch.tensor([[1, 2]], dtype=torch.int32, device=device)
        zeros = torch.zeros(2, dtype=torch.long, device=device)
        batch = ForwardBatch(zeros, zeros, zeros, zeros, zeros, table, prefills=[PrefillSlice(0, 2, block + 2, 0)])
        backend = FlashInferAttention(dtype, heads // kv_heads)
        backend.plan(batch)
        out = backend.attend(q, q[:, :kv_heads], q[:, :kv_heads], pool[:, 0], pool[:, 1], batch, head_dim**-0.5)
        torch.cuda.synchronize(device)
        return bool(torch.isfinite(out).all())
    except Exception as exc:  # not installed right, no module for this shape or GPU: the Triton kernels serve
        log.warning("FlashInfer is installed but does not run here without compiling (%s): not using it", exc)
        return False
    finally:
        if previous is None:
            os.environ.pop("FLASHINFER_DISABLE_JIT", None)
        else:
            os.environ["FLASHINFER_DISABLE_JIT"] = previous
