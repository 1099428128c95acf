"""Probe: the CUDA attention backend's kernels against SDPA, and the fused elementwise kernels against the
eager ops, on one layer of the llama-8b shape (32 query heads, 8 kv heads, head_dim 128, bf16) over a
scattered paged pool. Prints a table, writes JSON.

    python bench/probes/attention_kernels.py \
        --out bench/results/2026-12-01-h200-attention-kernels/attention-kernels.json   # on the H200
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton.testing

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rank_worker.model import fused_ops  # noqa: E402
from rank_worker.model.attention.prefill_kernel import KernelConfig, paged_prefill_attention  # noqa: E402
from rank_worker.model.attention.sdpa_backend import SdpaAttention  # noqa: E402
from rank_worker.model.attention.triton_backend import TritonAttention  # noqa: E402
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
DTYPE = torch.bfloat16
DEV = torch.device("cuda")


def pool_and_table(lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    blocks_needed = sum(-(-n // BLOCK) for n in lengths) + 1
    pool = torch.randn(blocks_needed, 1, 2, BLOCK, KV_HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    order = torch.randperm(blocks_needed - 1) + 1
    width = max(-(-n // BLOCK) for n in lengths)
    table = torch.zeros(len(lengths), width, dtype=torch.int32)
    used = 0
    for row, n in enumerate(lengths):
        count = -(-n // BLOCK)
        table[row, :count] = order[used : used + count]
        used += count
    return pool, table.to(DEV)


def batch_for(decodes: list[int], chunks: list[tuple[int, int]], table: torch.Tensor) -> ForwardBatch:
    total = len(decodes) + sum(new for new, _ in chunks)
    zeros = torch.zeros(total, dtype=torch.long, device=DEV)
    pieces, cursor = [], len(decodes)
    for row, (new, cached) in enumerate(chunks, start=len(decodes)):
        pieces.append(PrefillSlice(cursor, new, cached + new, row))
        cursor += new
    return ForwardBatch(
        zeros,
        zeros,
        zeros,
        zeros,
        zeros[:0],
        table,
        num_decodes=len(decodes),
        decode_rows=torch.arange(len(decodes), device=DEV),
        decode_lens=torch.tensor(decodes, device=DEV, dtype=torch.long),
        prefills=pieces,
    )


def time_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_graph_ms(fn) -> float:
    """GPU time without the host's launch cost (Triton launches cost ~20-40 us of Python each): replayed."""
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return time_ms(graph.replay)


def attention_flops(new: int, cached: int) -> float:
    return 4 * HEADS * HEAD_DIM * new * (cached + new / 2)


def prefill_case(new: int, cached: int) -> dict:
    pool, table = pool_and_table([new + cached])
    layer = pool[:, 0]
    batch = batch_for([], [(new, cached)], table)
    q = torch.randn(new, HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    k = torch.randn(new, KV_HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    v = torch.randn_like(k)
    scale = HEAD_DIM**-0.5
    row: dict = {"new": new, "cached": cached}
    backends = {
        "triton_packed": TritonAttention(DTYPE, HEADS // KV_HEADS, pack_gqa=True),
        "triton_per_head": TritonAttention(DTYPE, HEADS // KV_HEADS, pack_gqa=False),
        "sdpa": SdpaAttention(),
    }
    for name, backend in backends.items():
        backend.plan(batch)
        ms = time_ms(lambda b=backend: b.attend(q, k, v, layer[:, 0], layer[:, 1], batch, scale))
        row[f"{name}_ms"] = round(ms, 3)
        row[f"{name}_tflops"] = round(attention_flops(new, cached) / ms / 1e9, 1)
    return row


VARIANTS = [
    KernelConfig(128, 8, 3),
    KernelConfig(128, 8, 3, warp_specialize=True),
    KernelConfig(64, 8, 3, warp_specialize=True),
    KernelConfig(64, 8, 4),
    KernelConfig(128, 8, 4),
    KernelConfig(64, 4, 3),
]


def variant_case(new: int, cached: int) -> list[dict]:
    """The prefill kernel's launch configurations on one warm chunk (the backend uses CONFIGS)."""
    pool, table = pool_and_table([new + cached])
    layer = pool[:, 0]
    batch = batch_for([], [(new, cached)], table)
    q = torch.randn(new, HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    backend = TritonAttention(DTYPE, HEADS // KV_HEADS)
    backend.plan(batch)
    plan = batch.attention
    reference = torch.empty_like(q)
    paged_prefill_attention(
        q, layer[:, 0], layer[:, 1], table, plan.tile_piece, plan.tile_m, plan.piece_info, HEAD_DIM**-0.5, reference
    )
    rows = []
    for config in VARIANTS:
        out = torch.full_like(q, float("nan"))

        def launch(config=config, out=out):
            paged_prefill_attention(
                q, layer[:, 0], layer[:, 1], table, plan.tile_piece, plan.tile_m, plan.piece_info,
                HEAD_DIM**-0.5, out, config=config,
            )  # fmt: skip

        row = {"new": new, "cached": cached, "config": str(config)}
        try:
            ms = time_ms(launch)
            row["ms"] = round(ms, 3)
            row["tflops"] = round(attention_flops(new, cached) / ms / 1e9, 1)
            row["max_diff"] = float((out.float() - reference.float()).abs().max())
        except Exception as exc:  # a configuration the compiler refuses is a result too
            row["error"] = repr(exc)[:200]
        rows.append(row)
    return rows


def decode_case(batch_size: int, context: int) -> dict:
    pool, table = pool_and_table([context] * batch_size)
    layer = pool[:, 0]
    batch = batch_for([context] * batch_size, [], table)
    q = torch.randn(batch_size, HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    scale = HEAD_DIM**-0.5
    row: dict = {"batch": batch_size, "context": context}
    kv_bytes = 2 * batch_size * context * KV_HEADS * HEAD_DIM * 2
    for backend in (TritonAttention(DTYPE, HEADS // KV_HEADS), SdpaAttention()):
        backend.plan(batch)
        ms = time_ms(lambda b=backend: b.attend(q, q, q, layer[:, 0], layer[:, 1], batch, scale))
        row[f"{backend.name}_us"] = round(ms * 1000, 1)
        row[f"{backend.name}_tb_s"] = round(kv_bytes / ms / 1e9, 2)
    triton_backend = TritonAttention(DTYPE, HEADS // KV_HEADS)
    triton_backend.plan(batch)
    ms = time_graph_ms(lambda: triton_backend.attend(q, q, q, layer[:, 0], layer[:, 1], batch, scale))
    row["triton_graph_us"] = round(ms * 1000, 1)
    row["triton_graph_tb_s"] = round(kv_bytes / ms / 1e9, 2)
    return row


def elementwise_case(tokens: int) -> dict:
    hidden, inter = 4096, 14336
    x = torch.randn(tokens, hidden, device=DEV, dtype=DTYPE)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, device=DEV, dtype=DTYPE)
    gate_up = torch.randn(tokens, 2 * inter, device=DEV, dtype=DTYPE)

    def eager_norm():
        return fused_ops.rms_norm_reference(x + residual, weight, 1e-5)

    return {
        "tokens": tokens,
        "add_norm_eager_us": round(time_ms(eager_norm) * 1000, 1),
        "add_norm_fused_us": round(time_ms(lambda: fused_ops.add_rms_norm(x, residual, weight, 1e-5)) * 1000, 1),
        "silu_eager_us": round(time_ms(lambda: fused_ops.silu_and_mul_reference(gate_up)) * 1000, 1),
        "silu_fused_us": round(time_ms(lambda: fused_ops.silu_and_mul(gate_up)) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.manual_seed(0)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "prefill": [prefill_case(n, c) for n, c in ((8192, 0), (8192, 32768), (4096, 100000), (1024, 32768))],
        "decode": [decode_case(b, 4096) for b in (1, 16, 64, 128)] + [decode_case(8, 32768)],
        "elementwise": [elementwise_case(t) for t in (1, 64, 8192)],
        "variants": variant_case(8192, 32768) + variant_case(4096, 100000),
    }
    for section in ("prefill", "decode", "elementwise", "variants"):
        for row in result[section]:
            print(section, row, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
