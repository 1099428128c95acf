"""MLA decode attention read in place from the paged latent pool: a Triton kernel (CUDA only), the absorbed
form of attention/mla_sdpa.py without its gather.

Per token a layer's pool holds [c | k_pe] (kv_lora_rank + rope values, view [blocks, block_size, 1, r + rope])
shared by every head, so attention is MQA in latent space: a head's score is (q_lat . c + q_pe . k_pe) * scale
with q_lat = q_nope W_UK, and its output the softmax-weighted sum of c (W_UV is applied after, in PyTorch).
Each program takes a block of HEAD_BLOCK heads of one sequence over one slice of its context: the heads'
queries are loaded once and every tile of latents read from the blocks is scored against all of them (one
tl.dot for c, one for k_pe), with an online softmax. As in decode_kernel.py each row is cut into the same
number of slices whatever its length (split-K), none shorter than a floor (min_slice), so the grid depends on
the batch size alone and one CUDA graph per batch size serves every context length; decode_kernel.merge_slices
merges the slices. A short row fills its first slices only; the others write -inf as their lse and end.

An fp8 pool (kv_quant.py) is read as its values, cast to the model's dtype as they are loaded.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from rank_worker.model.attention import kv_quant
from rank_worker.model.attention.decode_kernel import merge_slices, slices_for

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without Triton
    triton = None
    tl = None

# Heads per program: tl.dot's smallest M. The latent tile is read once per head block (V2-Lite's 16 heads are
# one block; V3's 128 are eight, which read each tile from L2 after the first).
HEAD_BLOCK = 16
# Tokens scored per loop iteration: a tile of 512-value latents is 32 KB in bf16; float32 halves the tokens to
# keep the pipelined tiles in shared memory. Not tuned on a GPU yet.
TILE_TOKENS = {torch.float32: 16}
DEFAULT_TILE_TOKENS = 32
# Slicing where no measured launch applies. A V2-Lite row is one head block, so a few rows make few programs:
# with 64 slices a row, 2 agents at 60-100K tokens decoded at ~10% of HBM bandwidth on the H200 (vLLM ~50%).
# Aim at TARGET_PROGRAMS programs, up to MAX_SLICES a row, none
# shorter than MIN_SLICE tokens, so a short row fills only its first slices and the rest end at once.
TARGET_PROGRAMS = 2048
MAX_SLICES = 512
MIN_SLICE = 256
# Warps and pipeline depth of a program (Triton's defaults until the probe picks; TILE/slices may be set too).
LAUNCH: dict = {}
# Launch shapes by batch size that bench/probes/mla_decode_probe.py measured best on a GPU (--write-launch):
# {"gpus": {name: {"heads/rank/rope": {batch: {TILE, num_warps, num_stages, slices, min_slice}}}}}. A batch takes
# the entry of the largest measured batch not above it; other GPUs and shapes keep the defaults above.
LAUNCH_FILE = Path(__file__).with_name("mla_launch.json")


@functools.cache
def _measured(device_index: int, heads: int, rank: int, rope: int) -> tuple[tuple[int, dict], ...]:
    try:
        table = json.loads(LAUNCH_FILE.read_text())
    except FileNotFoundError:
        return ()
    by_batch = table.get("gpus", {}).get(torch.cuda.get_device_name(device_index), {}).get(f"{heads}/{rank}/{rope}", {})
    return tuple(sorted((int(batch), dict(shape)) for batch, shape in by_batch.items()))


def launch_for(entries: tuple[tuple[int, dict], ...], batch: int) -> dict:
    """The entry of the largest measured batch size not above `batch` (the smallest one below them all)."""
    chosen: dict = {}
    for measured_batch, shape in entries:
        if measured_batch > batch and chosen:
            break
        chosen = shape
    return dict(chosen)


def measured_launch(device: torch.device, batch: int, heads: int, rank: int, rope: int) -> dict:
    """The probe's launch shape for this batch size on this GPU ({} where none was measured)."""
    if device.type != "cuda":
        return {}
    index = device.index if device.index is not None else torch.cuda.current_device()
    return launch_for(_measured(index, heads, rank, rope), batch)


def default_slices(batch: int, head_blocks: int) -> int:
    """Slices a row (a power of two) for TARGET_PROGRAMS programs over the batch, at most MAX_SLICES."""
    return slices_for(batch, head_blocks, TARGET_PROGRAMS, MAX_SLICES)


def fits(kv_lora_rank: int) -> bool:
    """Whether the kernel takes this latent width (a power of two >= 16; any rope width is padded)."""
    return kv_lora_rank >= 16 and kv_lora_rank & (kv_lora_rank - 1) == 0


if triton is not None:

    @triton.jit
    def _mla_decode_slices(
        q_lat_ptr,
        q_pe_ptr,
        cache_ptr,
        tables_ptr,
        rows_ptr,
        lens_ptr,
        out_ptr,
        lse_ptr,
        stride_lat_seq,
        stride_lat_head,
        stride_pe_seq,
        stride_pe_head,
        stride_cache_block,
        stride_cache_token,
        stride_table_row,
        scale,
        num_slices,
        min_slice,
        NUM_HEADS: tl.constexpr,
        HEAD_BLOCK: tl.constexpr,
        RANK: tl.constexpr,
        ROPE: tl.constexpr,
        ROPE_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        head_block = tl.program_id(0)  # fastest: a sequence's head blocks run side by side and share its tiles
        seq = tl.program_id(1)
        piece = tl.program_id(2)
        length = tl.load(lens_ptr + seq).to(tl.int32)
        table = tables_ptr + tl.load(rows_ptr + seq).to(tl.int64) * stride_table_row
        heads = head_block * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
        head_ok = heads < NUM_HEADS
        dims = tl.arange(0, RANK)
        rope_dims = tl.arange(0, ROPE_PAD)
        rope_ok = rope_dims < ROPE
        # partial outputs: [seq, head, slice, r]; log-sum-exps: [seq, head, slice]
        lse_at = lse_ptr + (seq * NUM_HEADS + heads) * num_slices + piece
        out_at = out_ptr + ((seq * NUM_HEADS + heads) * num_slices + piece)[:, None] * RANK + dims[None, :]
        # Every row is cut into num_slices tile-aligned slices of its own length, none shorter than min_slice (a
        # multiple of TILE): a short row fills its first slices only, and the rest end here at once.
        per_slice = tl.maximum(tl.cdiv(tl.cdiv(length, num_slices), TILE) * TILE, min_slice)
        start = piece * per_slice
        if start >= length:
            # an empty slice: merge_slices weighs it 0 from its lse and does not read its partial output
            tl.store(lse_at, tl.full([HEAD_BLOCK], float("-inf"), tl.float32), mask=head_ok)
            return
        q_lat = tl.load(
            q_lat_ptr + seq * stride_lat_seq + heads[:, None] * stride_lat_head + dims[None, :],
            mask=head_ok[:, None],
            other=0.0,
        )
        q_pe = tl.load(
            q_pe_ptr + seq * stride_pe_seq + heads[:, None] * stride_pe_head + rope_dims[None, :],
            mask=head_ok[:, None] & rope_ok[None, :],
            other=0.0,
        )
        best = tl.full([HEAD_BLOCK], float("-inf"), tl.float32)
        total = tl.zeros([HEAD_BLOCK], tl.float32)
        acc = tl.zeros([HEAD_BLOCK, RANK], tl.float32)
        offsets = tl.arange(0, TILE)
        end = tl.minimum(length, start + per_slice)
        for tile_start in range(start, end, TILE):
            tokens = tile_start + offsets
            valid = tokens < end
            blocks = tl.load(table + tokens // BLOCK_SIZE, mask=valid, other=0)
            row_at = cache_ptr + blocks.to(tl.int64) * stride_cache_block + (tokens % BLOCK_SIZE) * stride_cache_token
            # .to: an fp8 pool's values (kv_quant's scale is 1.0); a no-op in the model's dtype
            c = tl.load(row_at[:, None] + dims[None, :], mask=valid[:, None], other=0.0).to(q_lat.dtype)  # [TILE, r]
            pe_ok = valid[:, None] & rope_ok[None, :]
            k_pe = tl.load(row_at[:, None] + RANK + rope_dims[None, :], mask=pe_ok, other=0.0).to(q_pe.dtype)
            scores = tl.dot(q_lat, tl.trans(c), input_precision=PRECISION)
            scores += tl.dot(q_pe, tl.trans(k_pe), input_precision=PRECISION)
            scores = tl.where(valid[None, :], scores * scale, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.exp(scores - new_best[:, None])
            rescale = tl.exp(best - new_best)
            total = total * rescale + tl.sum(weights, 1)
            acc = acc * rescale[:, None] + tl.dot(weights.to(c.dtype), c, input_precision=PRECISION)
            best = new_best
        tl.store(lse_at, best + tl.log(total), mask=head_ok)
        tl.store(out_at, acc / total[:, None], mask=head_ok[:, None])


def mla_decode_attention(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    launch: dict | None = None,
) -> torch.Tensor:
    """q_lat [S, H, r] (q_nope W_UK), q_pe [S, H, rope] (rotated), one token per sequence; latent_cache one
    layer's [blocks, block_size, 1, r + rope] view of the pool; block_tables [table rows, max_blocks] (int32),
    rows [S] the table row of each sequence, context_lens [S] (>= 1). Returns the attention-weighted latents
    [S, H, r] in q_lat's dtype. launch overrides the launch shape (bench/probes/mla_decode_probe.py's sweep):
    TILE (tokens a loop step), slices (per row), min_slice (tokens, the shortest slice), num_warps, num_stages;
    unset ones come from LAUNCH, then LAUNCH_FILE's entry for this GPU and batch size, then the defaults."""
    assert triton is not None, "the Triton MLA decode kernel needs triton (CUDA builds of torch ship it)"
    assert latent_cache.dtype in (q_lat.dtype, kv_quant.FP8), "the MLA kernel reads the model's dtype or fp8"
    num_seqs, num_heads, rank = q_lat.shape
    rope = q_pe.shape[2]
    block_size = latent_cache.shape[1]
    assert fits(rank) and latent_cache.shape[-1] == rank + rope, (rank, rope, tuple(latent_cache.shape))
    assert q_lat.stride(2) == 1 and q_pe.stride(2) == 1 and latent_cache.stride(3) == 1
    head_blocks = triton.cdiv(num_heads, HEAD_BLOCK)
    # the probe measures bf16 latents and queries; an fp8 pool or another dtype keeps the defaults
    measured = q_lat.dtype == latent_cache.dtype == torch.bfloat16
    shape = measured_launch(q_lat.device, num_seqs, num_heads, rank, rope) if measured else {}
    shape.update(LAUNCH, **(launch or {}))
    num_slices = shape.pop("slices", None) or default_slices(num_seqs, head_blocks)
    assert num_slices & (num_slices - 1) == 0, f"slices must be a power of two (the merge's arange): {num_slices}"
    tile = shape.pop("TILE", None) or TILE_TOKENS.get(q_lat.dtype, DEFAULT_TILE_TOKENS)
    min_slice = -(-int(shape.pop("min_slice", MIN_SLICE)) // tile) * tile  # a whole number of tiles
    partial = torch.empty(num_seqs, num_heads, num_slices, rank, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(num_seqs, num_heads, num_slices, dtype=torch.float32, device=q_lat.device)
    out = torch.empty_like(q_lat, memory_format=torch.contiguous_format)
    if not num_seqs:
        return out
    _mla_decode_slices[(head_blocks, num_seqs, num_slices)](
        q_lat,
        q_pe,
        latent_cache,
        block_tables,
        rows,
        context_lens,
        partial,
        lse,
        q_lat.stride(0),
        q_lat.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        block_tables.stride(0),
        scale,
        num_slices,
        min_slice,
        NUM_HEADS=num_heads,
        HEAD_BLOCK=HEAD_BLOCK,
        RANK=rank,
        ROPE=rope,
        ROPE_PAD=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=block_size,
        TILE=tile,
        PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",  # full fp32 products for fp32 models
        **shape,
    )
    merge_slices(partial, lse, out)
    return out
