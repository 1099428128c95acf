"""The CUDA MLA backend: decode rows by the Triton kernel reading each row's latents in place through the block
table (mla_decode_kernel.py); prefill chunks over their contexts' latents expanded into per-head K/V (k:
nope + rope dims, v: v dims), by mla_sdpa.py's SDPA as on the CPU or, where flash-attn 4 runs (an SM90 GPU,
16-bit: fa4_backend.usable, and its start-up compile passed: warm_up falls back to SDPA if not), by one FA4
varlen launch per layer for all of a step's chunks (q and the expanded
K/V concatenated, cu_seqlens for both; FA4's causal mask is aligned bottom-right, our chunk-over-prefix mask;
head dims 192/128 in DeepSeek's shapes). SDPA takes a warm chunk's mask as an explicit lower-right bias, which
sends it off the flash kernel. A step whose chunks' contexts together pass context_window_tokens runs a chunk at a
time instead, one past the window in windows of its context (mla_windows.py; FA4 returns each window's
log-sum-exp for the merge).

A decode-only step runs the W_UK fold, the kernel and the W_UV product: fixed shapes given the batch size, no
host sync, nothing gathered, so it can be recorded in a CUDA graph (the MoE's routed experts run sync-free
there: moe.py).
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from rank_worker.model.attention.fa4_backend import WARM_UP_STEPS
from rank_worker.model.attention.mla_decode_kernel import mla_decode_attention
from rank_worker.model.attention.mla_sdpa import MlaPrefill, MlaSdpaAttention
from rank_worker.model.attention.mla_windows import needs_windows
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice, require_adjacent

log = logging.getLogger(__name__)

# (new tokens, prefix window) of the window launches warm_up compiles
WINDOW_WARM_UP = [(2, 18), (300, 2300)]


class MlaTritonAttention(MlaSdpaAttention):
    name = "mla_triton"
    graph_safe = True
    fused_store = True  # the model's latent_store kernel writes the step's latents (and rotates q) on CUDA

    def __init__(self, fa4_shape: tuple[int, int, int, torch.dtype] | None = None) -> None:
        """fa4_shape: (heads, qk head dim, v head dim, model dtype) to run prefill through FA4; None: SDPA."""
        self.fa4_shape = fa4_shape

    @property
    def fa4_prefill(self) -> bool:
        return self.fa4_shape is not None

    def plan(self, batch: ForwardBatch) -> None:
        batch.attention = None  # the kernel reads the persistent block table through decode_rows; prefills too

    def decode_latent(
        self, q_lat: torch.Tensor, q_pe: torch.Tensor, latent_cache: torch.Tensor, batch: ForwardBatch, scale: float
    ) -> torch.Tensor:
        assert batch.decode_rows is not None and batch.decode_lens is not None
        return mla_decode_attention(
            q_lat, q_pe, latent_cache, batch.block_tables, batch.decode_rows, batch.decode_lens, scale
        )

    def prefill_chunks(self, step: MlaPrefill, out: torch.Tensor) -> None:
        if not self.fa4_prefill:
            super().prefill_chunks(step, out)
            return
        pieces = sorted(step.batch.prefills, key=lambda p: p.token_start)
        require_adjacent(pieces, "mla_triton")
        window = self.context_window_tokens
        if window is None or sum(p.context_len for p in pieces) <= window:
            self._fa4_launch(pieces, step, out)
            return
        # Past the window: a chunk at a time, each over at most a window of its context (mla_windows.py)
        for piece in pieces:
            if needs_windows(piece, window):
                out[piece.token_start : piece.token_start + piece.num_new] = self.windowed(piece, step)
            else:
                self._fa4_launch([piece], step, out)

    def _fa4_launch(self, pieces: list[PrefillSlice], step: MlaPrefill, out: torch.Tensor) -> None:
        """Adjacent chunks, each over its whole context expanded, in one FA4 varlen launch into out."""
        contexts = [step.context(p, 0, p.context_len) for p in pieces]
        k, v = step.expand(contexts[0] if len(contexts) == 1 else torch.cat(contexts))
        start, end = pieces[0].token_start, pieces[-1].token_start + pieces[-1].num_new
        q = whole_query(step.q_nope[start:end], step.q_pe[start:end])
        qo = list(itertools.accumulate((p.num_new for p in pieces), initial=0))
        ko = list(itertools.accumulate((p.context_len for p in pieces), initial=0))
        bounds = torch.tensor(qo + ko, dtype=torch.int32).to(q.device, non_blocking=True)
        _fa4_varlen(
            q,
            k,
            v,
            bounds[: len(qo)],
            bounds[len(qo) :],
            max(p.num_new for p in pieces),
            max(p.context_len for p in pieces),
            step.scale,
            out[start:end],
        )

    def window_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """mla_windows.WindowAttention by one FA4 launch, which returns the log-sum-exp ([H, n]) beside out."""
        if not self.fa4_prefill:
            return super().window_attention(q, k, v, scale, causal)
        n, m = q.shape[0], k.shape[0]
        bounds = torch.tensor([0, n, 0, m], dtype=torch.int32).to(q.device, non_blocking=True)
        out = q.new_empty(n, q.shape[1], v.shape[-1])
        lse = _fa4_varlen(q, k, v, bounds[:2], bounds[2:], n, m, scale, out, causal=causal, return_lse=True)
        assert lse is not None
        return out, lse.transpose(0, 1)

    def warm_up(self, kv_cache: torch.Tensor) -> float:
        """Compile FA4's variants for fa4_backend.WARM_UP_STEPS' steps now (start-up); returns the seconds."""
        if self.fa4_shape is None:
            return 0.0
        started = time.perf_counter()
        try:
            self._compile_fa4(kv_cache.device)
        except Exception as exc:  # FA4 installed but not running this shape here: SDPA serves prefill instead
            log.warning("flash-attn 4 failed its MLA warm-up (%s): MLA prefill runs SDPA", exc)
            self.fa4_shape = None
            return 0.0
        return time.perf_counter() - started

    def _compile_fa4(self, device: torch.device) -> None:
        assert self.fa4_shape is not None
        heads, qk_dim, v_dim, dtype = self.fa4_shape
        for chunks in WARM_UP_STEPS:
            qo = list(itertools.accumulate((new for new, _ in chunks), initial=0))
            ko = list(itertools.accumulate((context for _, context in chunks), initial=0))
            q = torch.zeros(qo[-1], heads, qk_dim, dtype=dtype, device=device)
            k = torch.zeros(ko[-1], heads, qk_dim, dtype=dtype, device=device)
            v = torch.zeros(ko[-1], heads, v_dim, dtype=dtype, device=device)
            bounds = torch.tensor(qo + ko, dtype=torch.int32, device=device)
            out = torch.empty(qo[-1], heads, v_dim, dtype=dtype, device=device)
            max_q, max_k = max(n for n, _ in chunks), max(c for _, c in chunks)
            _fa4_varlen(q, k, v, bounds[: len(qo)], bounds[len(qo) :], max_q, max_k, qk_dim**-0.5, out)
        # the windows' launches (mla_windows.py): a chunk's own tokens (causal) and a prefix window (every key),
        # each with its log-sum-exp, short and past one q tile
        for (new, context), causal in itertools.product(WINDOW_WARM_UP, (True, False)):
            q = torch.zeros(new, heads, qk_dim, dtype=dtype, device=device)
            k = torch.zeros(new if causal else context, heads, qk_dim, dtype=dtype, device=device)
            v = torch.zeros(k.shape[0], heads, v_dim, dtype=dtype, device=device)
            self.window_attention(q, k, v, qk_dim**-0.5, causal)
        torch.cuda.synchronize(device)


def whole_query(q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
    """[n, H, nope + rope], packed: a view when q_pe is the rest of each head of q_nope's tensor (LatentAttention
    splits one projection, and its fused kernel rotates q_pe in place) and its rows are packed, else a copy (the
    two joined; or V2's q, a column slice of the layer's one input projection, its rows apart by kv_a's width
    too: FA4 has only been run on packed rows, and the copy is small beside the chunk's attention)."""
    nope = q_nope.shape[-1]
    adjacent = (
        q_nope.stride() == q_pe.stride()
        and q_nope.stride(-1) == 1
        and q_pe.data_ptr() == q_nope.data_ptr() + nope * q_nope.element_size()
        and q_nope.stride(-2) >= nope + q_pe.shape[-1]
    )
    if not adjacent:
        return torch.cat([q_nope, q_pe], dim=-1)
    return q_nope.as_strided((*q_nope.shape[:-1], nope + q_pe.shape[-1]), q_nope.stride()).contiguous()


def _fa4_varlen(
    q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, out: torch.Tensor, causal=True, return_lse=False
) -> torch.Tensor | None:
    """FA4 over concatenated chunks: q [n, H, qk], k [m, H, qk], v [m, H, v] (a strided view is fine), into out;
    causal: aligned bottom-right (a chunk's rows see its context up to themselves), else every key. Returns the
    log-sum-exp [H, n] (float32) where return_lse, else None."""
    from flash_attn.cute.interface import _flash_attn_fwd  # lazily: CUDA steps with FA4 installed only

    _, lse, *_ = _flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=max_k,
        softmax_scale=scale,
        causal=causal,
        pack_gqa=False,
        return_lse=return_lse,
        out=out,
    )
    return lse if return_lse else None  # (FA4 computes none where not asked)
