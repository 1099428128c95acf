"""MLA prefill over a cached prefix in bounded windows (mla_windows.py): the same outputs as expanding a chunk's
whole context at once, for windows smaller than, equal to and past block and chunk sizes; the log-sum-exp merge
of disjoint key sets; the attention with log-sum-exp against SDPA; the engine bounding its backend by its
longest step. On the CPU, float32 (the FA4 variant is in test_cuda_mla.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from deepseek_checkpoints import load_ours, write_deepseek
from engine_fixtures import make_engine

from rank_worker.model.attention import kv_quant
from rank_worker.model.attention.mla_sdpa import MlaSdpaAttention
from rank_worker.model.attention.mla_windows import (
    attention_with_lse,
    merge_into,
    needs_windows,
    prefix_windows,
)
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice

BLOCK = 8
HEADS, NOPE, ROPE, V_DIM, RANK = 4, 16, 8, 12, 32
SCALE = (NOPE + ROPE) ** -0.5


def _prefill_batch(chunks: list[tuple[int, int]], num_blocks: int) -> tuple[ForwardBatch, int]:
    """A prefill-only step of chunks (new, cached), each in its own scattered blocks: the batch, its tokens."""
    order = (torch.randperm(num_blocks - 1) + 1).tolist()
    width = max(-(-(new + cached) // BLOCK) for new, cached in chunks)
    table = torch.zeros(len(chunks), width, dtype=torch.int32)
    pieces, used, start = [], 0, 0
    for row, (new, cached) in enumerate(chunks):
        count = -(-(new + cached) // BLOCK)
        table[row, :count] = torch.tensor(order[used : used + count])
        used += count
        pieces.append(PrefillSlice(start, new, new + cached, row))
        start += new
    batch = ForwardBatch(
        input_ids=torch.zeros(start, dtype=torch.long),
        positions=torch.zeros(start, dtype=torch.long),
        slot_blocks=torch.zeros(start, dtype=torch.long),
        slot_offsets=torch.zeros(start, dtype=torch.long),
        logits_indices=torch.zeros(0, dtype=torch.long),
        block_tables=table,
        prefills=pieces,
    )
    return batch, start


def _attend(
    backend: MlaSdpaAttention, chunks: list[tuple[int, int]], seed: int, pool_dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The step's prefill through backend, over a pool of random latents (a cold chunk's own latents are
    this step's): [tokens, H, v]."""
    torch.manual_seed(seed)
    num_blocks = 64
    pool = torch.randn(num_blocks, BLOCK, 1, RANK + ROPE).to(pool_dtype)
    batch, tokens = _prefill_batch(chunks, num_blocks)
    latent = torch.randn(tokens, RANK + ROPE)
    q_nope, q_pe = torch.randn(tokens, HEADS, NOPE), torch.randn(tokens, HEADS, ROPE)
    kv_b_proj = torch.randn(HEADS * (NOPE + V_DIM), RANK) * RANK**-0.5
    with torch.inference_mode():
        return backend.attend_mla(q_nope, q_pe, latent, pool, kv_b_proj, batch, SCALE)


CHUNKS = [(5, 30), (9, 0), (20, 50), (1, 99)]


@pytest.mark.parametrize("window", [1, 7, 8, 16, 50, 99])
def test_a_windowed_prefill_gives_the_whole_context_prefill(window) -> None:
    """Warm chunks (over 30, 50, 99 cached tokens), a cold one and a one-token chunk: every window size gives
    what expanding each whole context gives."""
    whole = _attend(MlaSdpaAttention(), CHUNKS, seed=3)
    bounded = MlaSdpaAttention()
    bounded.context_window_tokens = window
    assert any(needs_windows(PrefillSlice(0, n, n + c, 0), window) for n, c in CHUNKS)
    torch.testing.assert_close(_attend(bounded, CHUNKS, seed=3), whole, rtol=1e-5, atol=1e-5)


def test_windows_read_an_fp8_pool_as_the_whole_context_does() -> None:
    """Every context latent, a warm chunk's own ones too, dequantised from the pool alike."""
    bounded = MlaSdpaAttention()
    bounded.context_window_tokens = 16
    whole = _attend(MlaSdpaAttention(), CHUNKS, seed=4, pool_dtype=kv_quant.FP8)
    torch.testing.assert_close(_attend(bounded, CHUNKS, seed=4, pool_dtype=kv_quant.FP8), whole, rtol=1e-5, atol=1e-5)


def test_a_window_at_least_each_context_takes_the_whole_context_path() -> None:
    assert not any(needs_windows(PrefillSlice(0, n, n + c, 0), 150) for n, c in CHUNKS)
    assert not needs_windows(PrefillSlice(0, 40, 40, 0), 8)  # cold: its context is its own tokens
    assert not needs_windows(PrefillSlice(0, 4, 40, 0), None)


def test_prefix_windows_cover_the_cached_prefix_once_in_order() -> None:
    assert prefix_windows(PrefillSlice(0, 5, 35, 0), 8) == [(0, 8), (8, 16), (16, 24), (24, 30)]
    assert prefix_windows(PrefillSlice(0, 5, 35, 0), 30) == [(0, 30)]
    assert prefix_windows(PrefillSlice(0, 5, 5, 0), 8) == []


@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_lse_is_sdpa_and_its_log_sum_exp(causal, monkeypatch) -> None:
    """In several blocks of query rows (the score budget set to a few rows)."""
    torch.manual_seed(5)
    n, m = 13, 13 if causal else 21
    q, k, v = torch.randn(n, HEADS, 24), torch.randn(m, HEADS, 24), torch.randn(m, HEADS, V_DIM)
    monkeypatch.setattr("rank_worker.model.attention.mla_windows.SCORE_BLOCK_BYTES", HEADS * m * 4 * 3)
    out, lse = attention_with_lse(q, k, v, 0.3, causal)
    expected = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=causal, scale=0.3
    ).transpose(0, 1)
    scores = torch.einsum("nhd,mhd->nhm", q, k) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(n, m).triu(1).bool().unsqueeze(1), float("-inf"))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, torch.logsumexp(scores, dim=-1), rtol=1e-5, atol=1e-5)


def test_merging_two_key_sets_gives_the_attention_over_both() -> None:
    torch.manual_seed(6)
    q, k, v = torch.randn(7, HEADS, 24), torch.randn(30, HEADS, 24), torch.randn(30, HEADS, V_DIM)
    whole, whole_lse = attention_with_lse(q, k, v, 0.5, False)
    acc, lse = attention_with_lse(q, k[:11], v[:11], 0.5, False)
    part, part_lse = attention_with_lse(q, k[11:], v[11:], 0.5, False)
    merge_into(acc, lse, part, part_lse)
    torch.testing.assert_close(acc, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-5, atol=1e-5)


def test_the_engine_bounds_its_backend_by_its_longest_step(tmp_path) -> None:
    """max_num_batched_tokens, or a longer solo prefill where the scheduling asks for one."""
    write_deepseek("deepseek_v2", tmp_path)
    model, _ = load_ours(tmp_path)
    assert make_engine(model, max_num_batched_tokens=16).attention.context_window_tokens == 16
    solo = make_engine(model, max_num_batched_tokens=16, solo_prefill_tokens=64)
    assert solo.attention.context_window_tokens == 64
