"""MLA prefill over a long cached prefix in bounded windows: a chunk attends its own new tokens (causal) and its
cached prefix in ranges of at most `window` tokens (every query sees all of such a range), one range expanded
into per-head K/V at a time, and the partial outputs are merged by their log-sum-exp.

Why: MLA prefill expands a chunk's context latents into per-head K and V (~14 KB a token in DeepSeek-V2-Lite's
shape, 16 heads of 192 + 256 values in 16 bits), so a chunk over an agent's 800K-token context asked for several
GB at once, past what the pool's sizing left free: on an H100 (2026-12-05, 8 agents at the Claude Code traces'
real size) 30% of the calls failed with CUDA out of memory in that expansion. Bounded by the engine's longest
step, the expansion is never larger than the one the pool's sizing probe runs (factory._profile_peak_bytes runs
a chunk over a prefix, so the merge's buffers are in its peak too). vLLM's MLA prefill does the same over its
chunked-context workspace.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rank_worker.model.attention import kv_quant
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice

# (q [n, H, qk], k [m, H, qk], v [m, H, v], scale, causal) -> (out [n, H, v] in q's dtype, lse [n, H] float32, the
# natural log of each row's softmax denominator); causal: n == m and row i sees keys 0..i
WindowAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float, bool], tuple[torch.Tensor, torch.Tensor]]

# The float32 scores one block of query rows may take in attention_with_lse (a row's are heads x keys)
SCORE_BLOCK_BYTES = 256 * 1024**2


def needs_windows(piece: PrefillSlice, window: int | None) -> bool:
    """Whether a chunk's context is past the window and has a cached prefix to split (a cold chunk's context is
    its own tokens, no more than a step's, which the window is at least)."""
    return window is not None and piece.context_len > window and piece.context_len > piece.num_new


def prefix_windows(piece: PrefillSlice, window: int) -> list[tuple[int, int]]:
    """The chunk's cached prefix [0, context_len - num_new) as ranges of at most window tokens."""
    cached = piece.context_len - piece.num_new
    return [(start, min(start + window, cached)) for start in range(0, cached, window)]


def context_range(
    piece: PrefillSlice,
    start: int,
    end: int,
    latent: torch.Tensor,
    latent_cache: torch.Tensor,
    batch: ForwardBatch,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Context latents [start, end) of a chunk, [end - start, r + rope] in the model's dtype: its own (this
    step's) for a cold chunk's whole context, else read from the pool through its block-table row (an fp8 pool
    dequantised)."""
    if start == 0 and end == piece.num_new == piece.context_len:
        return latent[piece.token_start : piece.token_start + piece.num_new]
    block_size = latent_cache.shape[1]
    first, last = start // block_size, -(-end // block_size)
    table = batch.block_tables[piece.table_row, first:last].long()
    offset = start - first * block_size
    rows = latent_cache[table].reshape(-1, latent_cache.shape[-1])[offset : offset + end - start]
    return kv_quant.dequantize(rows, dtype)


def windowed_prefill(
    piece: PrefillSlice,
    q: torch.Tensor,
    expand: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    context: Callable[[int, int], torch.Tensor],
    window: int,
    attend: WindowAttention,
    scale: float,
) -> torch.Tensor:
    """One chunk's prefill, q [n, H, qk] -> [n, H, v]: its own tokens (causal), then each prefix window, merged.
    expand: latents -> (k, v); context(start, end): the chunk's context latents over that range."""
    cached = piece.context_len - piece.num_new
    k, v = expand(context(cached, piece.context_len))
    own, lse = attend(q, k, v, scale, True)
    del k, v
    acc = own.float()  # merged in float32, rounded once at the end
    del own
    for start, end in prefix_windows(piece, window):
        k, v = expand(context(start, end))
        part, part_lse = attend(q, k, v, scale, False)
        del k, v
        merge_into(acc, lse, part, part_lse)
        del part, part_lse  # not held through the next window's attention (the probe runs one window)
    return acc.to(q.dtype)


def merge_into(acc: torch.Tensor, lse: torch.Tensor, part: torch.Tensor, part_lse: torch.Tensor) -> None:
    """acc [n, H, v] float32 and lse [n, H] become the attention over both key sets (acc's and part's, disjoint):
    each output weighted by its share of the joint softmax denominator."""
    joint = torch.logaddexp(lse, part_lse)
    acc.mul_(torch.exp(lse - joint).unsqueeze(-1)).add_(part.float() * torch.exp(part_lse - joint).unsqueeze(-1))
    lse.copy_(joint)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """WindowAttention in PyTorch (the SDPA backend's: SDPA returns no log-sum-exp): float32 scores, in blocks of
    query rows whose scores stay under SCORE_BLOCK_BYTES."""
    n, heads, _ = q.shape
    m = k.shape[0]
    keys, values = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [H, m, *]
    out = q.new_empty(n, heads, v.shape[-1])
    lse = torch.empty(n, heads, dtype=torch.float32, device=q.device)
    rows = max(1, SCORE_BLOCK_BYTES // (heads * m * 4))
    for first in range(0, n, rows):
        last = min(n, first + rows)
        scores = torch.matmul(q[first:last].float().transpose(0, 1), keys.transpose(1, 2)) * scale  # [H, r, m]
        if causal:
            later = torch.arange(m, device=q.device) > torch.arange(first, last, device=q.device).unsqueeze(1)
            scores.masked_fill_(later, float("-inf"))
        block_lse = torch.logsumexp(scores, dim=-1)  # [H, r]
        weights = torch.exp(scores - block_lse.unsqueeze(-1))
        out[first:last] = torch.matmul(weights, values).transpose(0, 1).to(out.dtype)
        lse[first:last] = block_lse.transpose(0, 1)
    return out, lse
