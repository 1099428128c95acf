"""An MLA layer's elementwise work between its projections and attention, in one Triton kernel per step on CUDA:
kv_a_layernorm of the compressed latent c, the rotary of k_pe and of every head's q_pe, and the store of
[norm(c) | rotated k_pe] at each token's pool slot.

In eager PyTorch (mla.py's path, which the CPU and the SDPA backend keep) this is ~30 kernels a layer (two
rotaries of a dozen ops each, a norm of six, a cat, the store): a V2-Lite decode step of one token spent more of
its time launching them than reading weights. The kernel rounds where those ops round (to the model's dtype
after every op that would store a tensor: fused_ops' convention), so it gives their bits, and an fp8 pool gets
kv_quant's saturated values (the latent handed back for the step's own prefill chunks is the pool's value, as
kv_quant.round_trip gives).
"""

from __future__ import annotations

import torch

from rank_worker.model.attention import kv_quant
from rank_worker.model.fused_ops import triton

if triton is not None:
    import triton.language as tl

    from rank_worker.model.fused_ops import _for_pool

    @triton.jit
    def _rotate(x1, x2, cos, sin):
        """x * cos + rotate_half(x) * sin on the two halves, each product and sum rounded to x's dtype."""
        dtype = x1.dtype
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        out1 = ((x1f * cos).to(dtype).to(tl.float32) - (x2f * sin).to(dtype).to(tl.float32)).to(dtype)
        out2 = ((x2f * cos).to(dtype).to(tl.float32) + (x1f * sin).to(dtype).to(tl.float32)).to(dtype)
        return out1, out2

    @triton.jit
    def _latent_rope_norm_store(
        q_ptr,
        kv_a_ptr,
        positions_ptr,
        cos_ptr,
        sin_ptr,
        norm_weight_ptr,
        slot_blocks_ptr,
        slot_offsets_ptr,
        cache_ptr,
        latent_ptr,
        eps,
        stride_q_token,
        stride_q_head,
        stride_kv_a,
        stride_cache_block,
        stride_cache_token,
        NUM_HEADS: tl.constexpr,
        HEADS_PAD: tl.constexpr,
        NOPE: tl.constexpr,
        RANK: tl.constexpr,
        RANK_PAD: tl.constexpr,
        HALF: tl.constexpr,
        INTERLEAVED: tl.constexpr,
        QUANT: tl.constexpr,
    ):
        """One token: q_pe of every head rotated in place, [norm(c) | rotated k_pe] into the pool and latent."""
        token = tl.program_id(0).to(tl.int64)
        position = tl.load(positions_ptr + token)
        dims = tl.arange(0, HALF)
        # float32 cos/sin (the YaRN attention factor applied), cast to the model's dtype as the eager op does
        row = kv_a_ptr + token * stride_kv_a
        dtype = kv_a_ptr.dtype.element_ty
        cos = tl.load(cos_ptr + position * HALF + dims).to(dtype).to(tl.float32)
        sin = tl.load(sin_ptr + position * HALF + dims).to(dtype).to(tl.float32)
        # A half-split head's halves are [0, HALF) and [HALF, 2 HALF); an interleaved one's the even and odd
        # values. The output is half-split either way (transformers' DeepSeek rotary de-interleaves).
        first = dims * 2 if INTERLEAVED else dims
        second = first + 1 if INTERLEAVED else dims + HALF

        # kv_a_layernorm(c): fused_ops._add_rms_norm's arithmetic without the residual
        cols = tl.arange(0, RANK_PAD)
        ok = cols < RANK
        c = tl.load(row + cols, mask=ok, other=0.0)
        cf = c.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(cf * cf, axis=0) / RANK + eps)
        normed = (cf * rstd).to(dtype).to(tl.float32)
        weight = tl.load(norm_weight_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        c_out = (weight * normed).to(dtype)

        k1, k2 = _rotate(tl.load(row + RANK + first), tl.load(row + RANK + second), cos, sin)

        slot = (
            tl.load(slot_blocks_ptr + token) * stride_cache_block
            + tl.load(slot_offsets_ptr + token) * stride_cache_token
        )
        c_pool = _for_pool(c_out, QUANT).to(cache_ptr.dtype.element_ty)
        k1_pool = _for_pool(k1, QUANT).to(cache_ptr.dtype.element_ty)
        k2_pool = _for_pool(k2, QUANT).to(cache_ptr.dtype.element_ty)
        tl.store(cache_ptr + slot + cols, c_pool, mask=ok)
        tl.store(cache_ptr + slot + RANK + dims, k1_pool)
        tl.store(cache_ptr + slot + RANK + HALF + dims, k2_pool)
        # what this step's own prefill chunks attend to: the pool's values in the model's dtype
        latent = latent_ptr + token * (RANK + 2 * HALF)
        tl.store(latent + cols, c_pool.to(dtype), mask=ok)
        tl.store(latent + RANK + dims, k1_pool.to(dtype))
        tl.store(latent + RANK + HALF + dims, k2_pool.to(dtype))

        heads = tl.arange(0, HEADS_PAD)[:, None]
        head_ok = heads < NUM_HEADS
        q_at = q_ptr + token * stride_q_token + heads * stride_q_head + NOPE
        q1, q2 = _rotate(
            tl.load(q_at + first[None, :], mask=head_ok, other=0.0),
            tl.load(q_at + second[None, :], mask=head_ok, other=0.0),
            cos[None, :],
            sin[None, :],
        )
        # Half-split in place: an interleaved head's loads above are all done before these stores.
        tl.store(q_at + dims[None, :], q1, mask=head_ok)
        tl.store(q_at + HALF + dims[None, :], q2, mask=head_ok)


def latent_rope_norm_store(
    q: torch.Tensor,
    kv_a: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    slot_blocks: torch.Tensor,
    slot_offsets: torch.Tensor,
    latent_cache: torch.Tensor,
    interleaved: bool,
) -> torch.Tensor:
    """q [T, H, nope + rope] (its rope part rotated in place, half-split), kv_a [T, r + rope] ([c | k_pe], rows
    contiguous), cos/sin caches [positions, rope / 2] (float32), latent_cache one layer's [blocks, block_size,
    1, r + rope] view. Stores [kv_a_layernorm(c) | rotated k_pe] at each token's slot and returns it [T, r + rope]
    as the pool holds it, in the model's dtype."""
    assert triton is not None
    tokens, heads, head_dim = q.shape
    rank = norm_weight.shape[0]
    rope = kv_a.shape[1] - rank
    assert q.stride(2) == 1 and kv_a.stride(1) == 1 and latent_cache.stride(3) == 1
    assert rope % 2 == 0 and rope & (rope - 1) == 0 and latent_cache.shape[-1] == rank + rope, (rank, rope)
    latent = torch.empty(tokens, rank + rope, dtype=kv_a.dtype, device=kv_a.device)
    if not tokens:
        return latent
    _latent_rope_norm_store[(tokens,)](
        q,
        kv_a,
        positions,
        cos_cache,
        sin_cache,
        norm_weight,
        slot_blocks,
        slot_offsets,
        latent_cache,
        latent,
        eps,
        q.stride(0),
        q.stride(1),
        kv_a.stride(0),
        latent_cache.stride(0),
        latent_cache.stride(1),
        NUM_HEADS=heads,
        HEADS_PAD=triton.next_power_of_2(heads),
        NOPE=head_dim - rope,
        RANK=rank,
        RANK_PAD=triton.next_power_of_2(rank),
        HALF=rope // 2,
        INTERLEAVED=interleaved,
        QUANT=kv_quant.is_quantised(latent_cache),
        num_warps=4,
    )
    return latent


def fits(rope: int) -> bool:
    """The kernel loads half the rotary part as one tile side: a power of two (V2/V3: 64)."""
    return rope >= 4 and rope & (rope - 1) == 0
