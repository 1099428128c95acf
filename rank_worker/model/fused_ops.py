"""The decoder's elementwise work fused into one Triton kernel each on CUDA (residual add + RMSNorm, SiLU x up,
rotary + the K/V store into the paged pool), with the plain PyTorch ops they replace for the CPU.

Each eager op reads and writes its whole tensor: an 8K-token prefill of an 8B model spent ~40 ms per step in
~20 such passes per layer, and a decode step ~1,000 extra launches. The kernels round where the PyTorch ops
round (to the model's dtype after every op that would store a tensor), so on CUDA they give the eager path's
bits, not merely its values, and the CPU path stays exact against transformers in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rank_worker.model.attention import kv_quant

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None
    tl = None


def kernels_available(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


# --- reference (CPU) versions: what the kernels must equal ---


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32 as the reference does, so bf16 runs do not drift.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- kernels ---

if triton is not None:

    @triton.jit
    def _add_rms_norm(
        x_ptr,
        residual_ptr,
        out_ptr,
        weight_ptr,
        width,
        stride_x,
        eps,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
        if HAS_RESIDUAL:
            # residual += x, rounded to the model's dtype as the eager add stores it
            x = (x.to(tl.float32) + tl.load(residual_ptr + row * width + cols, mask=ok, other=0.0).to(tl.float32)).to(
                x.dtype
            )
            tl.store(residual_ptr + row * width + cols, x, mask=ok)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / width + eps)
        normed = (xf * rstd).to(x.dtype).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (weight * normed).to(x.dtype), mask=ok)

    @triton.jit
    def _silu_and_mul(gate_up_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        gate = tl.load(gate_up_ptr + row * 2 * width + cols, mask=ok, other=0.0)
        up = tl.load(gate_up_ptr + row * 2 * width + width + cols, mask=ok, other=0.0)
        gf = gate.to(tl.float32)
        silu = (gf / (1.0 + tl.exp(-gf))).to(gate.dtype).to(tl.float32)
        tl.store(out_ptr + row * width + cols, (silu * up.to(tl.float32)).to(gate.dtype), mask=ok)

    @triton.jit
    def _for_pool(x, QUANT: tl.constexpr):
        """x as the pool stores it: an fp8 pool (QUANT) saturates at e4m3's +-448 first, as kv_quant.quantize
        does (the store's cast rounds to nearest even, as torch's); else unchanged."""
        if QUANT:
            x = tl.minimum(tl.maximum(x.to(tl.float32), -448.0), 448.0)
        return x

    @triton.jit
    def _rope_and_store(
        qkv_ptr,
        positions_ptr,
        cos_ptr,
        sin_ptr,
        slot_blocks_ptr,
        slot_offsets_ptr,
        k_cache_ptr,
        v_cache_ptr,
        stride_qkv,
        stride_cache_block,
        stride_cache_token,
        stride_cache_head,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        KV_HEADS_PAD: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        APPLY_ROPE: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        """One token: rotate its q and k heads in place in the qkv row, and store k and v at its pool slot."""
        token = tl.program_id(0).to(tl.int64)
        half = HALF
        dims = tl.arange(0, HALF)
        row = qkv_ptr + token * stride_qkv
        slot = (
            tl.load(slot_blocks_ptr + token) * stride_cache_block
            + tl.load(slot_offsets_ptr + token) * stride_cache_token
        )
        kv_heads = tl.arange(0, KV_HEADS_PAD)[:, None]
        kv_ok = kv_heads < NUM_KV_HEADS
        k_at = row + NUM_HEADS * HEAD_DIM + kv_heads * HEAD_DIM + dims[None, :]
        cache_at = slot + kv_heads * stride_cache_head + dims[None, :]
        k1 = tl.load(k_at, mask=kv_ok, other=0.0)
        k2 = tl.load(k_at + half, mask=kv_ok, other=0.0)
        if APPLY_ROPE:
            position = tl.load(positions_ptr + token)
            # The cache holds float32 cos/sin; the eager path casts them to the model's dtype first.
            cos = tl.load(cos_ptr + position * HEAD_DIM + dims).to(k1.dtype).to(tl.float32)[None, :]
            sin = tl.load(sin_ptr + position * HEAD_DIM + dims).to(k1.dtype).to(tl.float32)[None, :]
            heads = tl.arange(0, HEADS_PAD)[:, None]
            q_ok = heads < NUM_HEADS
            q_at = row + heads * HEAD_DIM + dims[None, :]
            q1 = tl.load(q_at, mask=q_ok, other=0.0)
            q2 = tl.load(q_at + half, mask=q_ok, other=0.0)
            # x * cos + rotate_half(x) * sin, each product and the sum rounded as the eager ops store them
            dtype = q1.dtype
            q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
            q1_out = ((q1f * cos).to(dtype).to(tl.float32) + (-q2f * sin).to(dtype).to(tl.float32)).to(dtype)
            q2_out = ((q2f * cos).to(dtype).to(tl.float32) + (q1f * sin).to(dtype).to(tl.float32)).to(dtype)
            tl.store(q_at, q1_out, mask=q_ok)
            tl.store(q_at + half, q2_out, mask=q_ok)
            k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
            k1 = ((k1f * cos).to(dtype).to(tl.float32) + (-k2f * sin).to(dtype).to(tl.float32)).to(dtype)
            k2 = ((k2f * cos).to(dtype).to(tl.float32) + (k1f * sin).to(dtype).to(tl.float32)).to(dtype)
            tl.store(k_at, k1, mask=kv_ok)
            tl.store(k_at + half, k2, mask=kv_ok)
        tl.store(k_cache_ptr + cache_at, _for_pool(k1, QUANT), mask=kv_ok)
        tl.store(k_cache_ptr + cache_at + half, _for_pool(k2, QUANT), mask=kv_ok)
        v_at = row + (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM + kv_heads * HEAD_DIM + dims[None, :]
        v1 = tl.load(v_at, mask=kv_ok, other=0.0)
        v2 = tl.load(v_at + half, mask=kv_ok, other=0.0)
        tl.store(v_cache_ptr + cache_at, _for_pool(v1, QUANT), mask=kv_ok)
        tl.store(v_cache_ptr + cache_at + half, _for_pool(v2, QUANT), mask=kv_ok)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x (in place) when given, then RMSNorm of the sum (of x alone without a residual); [T, H]. x
    may be a column slice of a wider product (rows strided: MLA's q_a); the residual and the result are not."""
    assert triton is not None
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows, width = x.shape
    if rows:
        block = triton.next_power_of_2(width)
        _add_rms_norm[(rows,)](
            x,
            x if residual is None else residual,
            out,
            weight,
            width,
            x.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(4, block // 512)),
        )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] ([T, 2I] -> [T, I])."""
    assert triton is not None
    gate_up = gate_up.contiguous()
    rows, double = gate_up.shape
    width = double // 2
    out = torch.empty(rows, width, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = 1024
        _silu_and_mul[(rows, triton.cdiv(width, block))](gate_up, out, width, BLOCK=block, num_warps=4)
    return out


def rope_and_store(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor | None,
    sin_cache: torch.Tensor | None,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    """Rotate q and k in place in qkv ([T, (Hq + 2 Hkv) D], rows contiguous) and store k and v in the pool
    (one layer's [blocks, block_size, Hkv, D] views; an fp8 pool gets them quantised as kv_quant.store does).
    Without cos/sin (a NoPE layer) only the store."""
    assert triton is not None
    assert qkv.stride(1) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    tokens = qkv.shape[0]
    if not tokens:
        return
    rope = cos_cache is not None and sin_cache is not None
    _rope_and_store[(tokens,)](
        qkv,
        positions,
        cos_cache if rope else qkv,
        sin_cache if rope else qkv,
        slot_blocks,
        slot_offsets,
        k_cache,
        v_cache,
        qkv.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEADS_PAD=triton.next_power_of_2(num_heads),
        KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        APPLY_ROPE=rope,
        QUANT=kv_quant.is_quantised(k_cache),
        num_warps=4,
    )


def rope_store_fits(head_dim: int) -> bool:
    """The rotary kernel loads half a head as one tile side: Triton needs a power of two (heads are padded)."""
    return head_dim >= 32 and head_dim & (head_dim - 1) == 0
