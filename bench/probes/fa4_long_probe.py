"""Probe: where flash-attn 4's SM90 forward loses time on a cold 100K prompt's chunks (the one engine measure of
issue 13 under 0.95x vLLM: 0.9499 on 2026-12-03, a gap that grows with the prompt, so in long attention).

One llama-8b layer, bf16. For the chunks a 101,024-token cold prompt is cut into (at 16K, 32K and 64K chunk
budgets) it times FA4 as the engine calls it (16-token pages of the block-major pool, scattered), then the same
chunks with 128-token pages (FA4 loads K/V by TMA only when the page equals its 128-token tile; at 16 it falls
back to cp.async, bench/probes/fa4_probe.py's question at 32/64 did not reach 128), with contiguous K/V (no page
table: the cost of paging at all), and with other tile / overlap options through run_fa4's options. Prints one
line per case and writes JSON to --out (or $OUT/fa4_long_probe.json). Run after `source bench/fa4_env.sh`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

from flashinfer_probe import HEAD_DIM, HEADS, KV_HEADS, LAYERS, attention_flops, step, time_ms  # noqa: E402

from rank_worker.model.attention.fa4_backend import Fa4Attention, run_fa4  # noqa: E402

PROMPT = 101_024  # bench/peer_plan.py's ttft_cold_100k_1k
OPTIONS = {  # run_fa4 options beyond the engine's (pack_gqa off); FA4 picks (128, 128, rs, overlap) for hdim 128
    "default": {},
    "tile_128x64": {"tile_mn": (128, 64)},
    "tile_128x112": {"tile_mn": (128, 112)},
    "tile_128x176": {"tile_mn": (128, 176)},
    "no_rs": {"mma_pv_is_rs": False},
    "no_overlap": {"intra_wg_overlap": False},
    "pack_gqa": {"pack_gqa": True},
}


def chunks(budget: int) -> list[tuple[int, int]]:
    """(new, cached) of each chunk of the cold prompt under a chunk budget of `budget` tokens."""
    out, done = [], 0
    while done < PROMPT:
        new = min(budget, PROMPT - done)
        out.append((new, done))
        done += new
    return out


def paged_ms(new: int, cached: int, block: int, **options) -> float:
    q, _, _, layer, batch = step([], [(new, cached)], LAYERS if block == 16 else 4, block, True)
    backend = Fa4Attention(q.dtype, HEADS // KV_HEADS)
    backend.plan(batch)
    out = torch.empty_like(q)
    args = (q, layer[:, 0], layer[:, 1], batch.attention, HEAD_DIM**-0.5, out)
    run_fa4(*args, **options)  # compile outside the timing
    ms = time_ms(lambda: run_fa4(*args, **options))
    del q, layer, batch, out
    torch.cuda.empty_cache()
    return ms


def contiguous_ms(new: int, cached: int) -> float:
    from flash_attn.cute.interface import _flash_attn_fwd

    total = new + cached
    q = torch.randn(new, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    cu_q = torch.tensor([0, new], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, total], device="cuda", dtype=torch.int32)

    def call() -> None:
        _flash_attn_fwd(
            q,
            k,
            v,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=new,
            max_seqlen_k=total,
            softmax_scale=HEAD_DIM**-0.5,
            causal=True,
            pack_gqa=False,
        )

    call()
    return time_ms(call)


def main() -> int:
    parser = argparse.ArgumentParser()
    out = os.path.join(os.environ["OUT"], "fa4_long_probe.json") if "OUT" in os.environ else ""
    parser.add_argument("--out", default=out)
    parser.add_argument("--options", default=",".join(OPTIONS))
    args = parser.parse_args()
    rows: list[dict] = []

    def record(row: dict) -> None:
        row["tflops"] = round(attention_flops(row["new"], row["cached"]) / row["ms"] / 1e9, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))

    for budget in (32768, 16384, 65536):
        for new, cached in chunks(budget):
            base = {"budget": budget, "new": new, "cached": cached}
            for variant in ("default",) if budget != 32768 else args.options.split(","):
                try:
                    record(base | {"case": f"paged16_{variant}", "ms": paged_ms(new, cached, 16, **OPTIONS[variant])})
                except Exception as error:  # a variant FA4 refuses is a result, not the end of the probe
                    print(json.dumps(base | {"case": f"paged16_{variant}", "error": str(error)[:200]}), flush=True)
            if budget == 32768:
                record(base | {"case": "paged128_default", "ms": paged_ms(new, cached, 128)})
                record(base | {"case": "contiguous_default", "ms": contiguous_ms(new, cached)})
    totals: dict[str, float] = {}
    for row in rows:
        key = f"{row['budget']}:{row['case']}"
        totals[key] = round(totals.get(key, 0.0) + row["ms"], 3)
    print("per-layer ms for the whole cold prompt:", json.dumps(totals, indent=1), flush=True)
    if args.out:
        Path(args.out).write_text(
            json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows, "totals_ms": totals}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
