"""One MoE layer's routed experts at decode batch sizes, two ways: torch._grouped_mm (the gather, both grouped
GEMMs and SiLU x up, as MoE.grouped_experts runs prefill chunks) and moe_mlp_kernel's two Triton kernels over a
sweep of launch shapes. Routing is uniform (each token's k experts drawn at random: ~51 of V2-Lite's 64 hit at
16 tokens) or narrow (every token on the same k experts, what vLLM's dummy weights give). Prints a table and
writes JSON: microseconds, experts hit, and the share of the H200's ~4.8 TB/s the weights read reached.

    python3 bench/probes/moe_probe.py --shape dsv2-lite-chat --out $OUT/moe-probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rank_worker.model import fused_ops, moe_kernels, moe_mlp_kernel  # noqa: E402

PEAK_BYTES_S = 4.8e12
SHAPES = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages) at BLOCK_M 16, then two at BLOCK_M 32
    {"BLOCK_M": 16, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
    for n, k, w, s in [
        (32, 128, 4, 4),
        (32, 256, 4, 4),
        (64, 64, 4, 4),
        (64, 128, 4, 3),
        (64, 128, 4, 4),
        (64, 128, 4, 5),
        (64, 256, 4, 3),
        (64, 256, 8, 4),
        (128, 64, 4, 4),
        (128, 128, 8, 3),
    ]
] + [
    {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4},
    {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4},
]


# Prefill-sized batches (thousands of rows an expert): the same kernels as a tiled GEMM with the gather fused,
# against the grouped GEMMs prefill runs today.
PREFILL_SHAPES = [
    {"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
    for m, n, k, w, s in [
        (64, 128, 64, 4, 4),
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 256, 64, 8, 3),
        (64, 256, 64, 8, 4),
    ]
]


def bench_us(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


def one_case(tokens: int, routing: str, gate_up: torch.Tensor, down_w: torch.Tensor, k: int) -> dict:
    experts, double_inter, hidden = gate_up.shape
    dev = gate_up.device
    torch.manual_seed(tokens)
    if routing == "uniform":
        ids = torch.rand(tokens, experts, device=dev).topk(k, dim=1).indices
    else:
        ids = torch.arange(k, device=dev).repeat(tokens, 1)
    x = torch.randn(tokens, hidden, device=dev).to(gate_up.dtype)
    token_of_row, _, ends = moe_kernels.align(ids, experts)
    hit = int(torch.unique(ids).numel())
    weight_bytes = hit * 3 * (double_inter // 2) * hidden * gate_up.element_size()

    def grouped():
        h = torch._grouped_mm(x.index_select(0, token_of_row), gate_up.transpose(1, 2), offs=ends)
        return torch._grouped_mm(fused_ops.silu_and_mul(h), down_w.transpose(1, 2), offs=ends)

    reference = grouped().float()
    grouped_us = bench_us(grouped)
    act = moe_mlp_kernel.gate_up_silu(x, gate_up, token_of_row, ends)
    best: dict[str, tuple[float, dict]] = {}
    sweep = []
    for shape in SHAPES:
        try:
            out = moe_mlp_kernel.expert_mlp(x, gate_up, down_w, token_of_row, ends, shape, shape)
            err = float((out.float() - reference).norm() / reference.norm())
            up_us = bench_us(lambda s=shape: moe_mlp_kernel.gate_up_silu(x, gate_up, token_of_row, ends, s))
            down_us = bench_us(lambda s=shape: moe_mlp_kernel.down(act, down_w, ends, s))
        except Exception as exc:  # a shape past the shared memory: noted, the sweep goes on
            sweep.append({"shape": shape, "error": str(exc)[:200]})
            continue
        sweep.append({"shape": shape, "gate_up_us": up_us, "down_us": down_us, "rel_err": err})
        for name, us in (("gate_up", up_us), ("down", down_us)):
            if name not in best or us < best[name][0]:
                best[name] = (us, shape)
    default_us = bench_us(lambda: moe_mlp_kernel.expert_mlp(x, gate_up, down_w, token_of_row, ends))
    kernel_us = best["gate_up"][0] + best["down"][0]
    return {
        "tokens": tokens,
        "routing": routing,
        "experts_hit": hit,
        "grouped_mm_us": grouped_us,
        "kernels_default_us": default_us,
        "kernels_best_us": kernel_us,
        "best_gate_up": best["gate_up"][1],
        "best_down": best["down"][1],
        "grouped_mm_bandwidth_share": weight_bytes / (grouped_us * 1e-6) / PEAK_BYTES_S,
        "kernels_default_bandwidth_share": weight_bytes / (default_us * 1e-6) / PEAK_BYTES_S,
        "kernels_best_bandwidth_share": weight_bytes / (kernel_us * 1e-6) / PEAK_BYTES_S,
        "sweep": sweep,
    }


def prefill_case(tokens: int, gate_up: torch.Tensor, down_w: torch.Tensor, k: int) -> dict:
    """Uniform routing of `tokens` tokens, the pairs sorted as MoE.grouped_experts sorts a prefill chunk's."""
    experts, double_inter, hidden = gate_up.shape
    dev = gate_up.device
    torch.manual_seed(tokens)
    ids = torch.rand(tokens, experts, device=dev).topk(k, dim=1).indices
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(experts, dtype=torch.int32, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32)
    )
    ends = counts.cumsum(0, dtype=torch.int32)
    token_of_row = order // k
    x = torch.randn(tokens, hidden, device=dev).to(gate_up.dtype)
    flops = 2 * flat.numel() * 3 * (double_inter // 2) * hidden

    def grouped():
        h = torch._grouped_mm(x.index_select(0, token_of_row), gate_up.transpose(1, 2), offs=ends)
        return torch._grouped_mm(fused_ops.silu_and_mul(h), down_w.transpose(1, 2), offs=ends)

    reference = grouped().float()
    grouped_us = bench_us(grouped)
    sweep = []
    for shape in PREFILL_SHAPES:
        try:
            out = moe_mlp_kernel.expert_mlp(x, gate_up, down_w, token_of_row, ends, shape, shape).float()
            err = float((out - reference).norm() / reference.norm())
            us = bench_us(lambda s=shape: moe_mlp_kernel.expert_mlp(x, gate_up, down_w, token_of_row, ends, s, s))
        except Exception as exc:  # past the shared memory: noted, the sweep goes on
            sweep.append({"shape": shape, "error": str(exc)[:200]})
            continue
        sweep.append({"shape": shape, "us": us, "tflops": flops / us / 1e6, "rel_err": err})
    best = min((r for r in sweep if "us" in r), key=lambda r: r["us"])
    return {
        "tokens": tokens,
        "routing": "uniform",
        "grouped_mm_us": grouped_us,
        "grouped_mm_tflops": flops / grouped_us / 1e6,
        "kernels_best": best,
        "sweep": sweep,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="dsv2-lite-chat")
    parser.add_argument("--tokens", default="1,16,64,128,256")
    parser.add_argument("--prefill-tokens", default="2048,8192")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    cfg = json.loads((ROOT / "bench" / "shapes" / args.shape / "config.json").read_text())
    experts, k = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gate_up = (torch.randn(experts, 2 * inter, hidden, device=dev) * 0.02).to(dtype)
    down_w = (torch.randn(experts, hidden, inter, device=dev) * 0.02).to(dtype)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",") if t]:
        for routing in ("uniform", "narrow"):
            row = one_case(tokens, routing, gate_up, down_w, k)
            rows.append(row)
            print(
                f"{tokens:4d} {routing:8s} hit {row['experts_hit']:3d}  grouped_mm {row['grouped_mm_us']:8.1f} us "
                f"({row['grouped_mm_bandwidth_share']:.0%})  kernels default {row['kernels_default_us']:8.1f} "
                f"({row['kernels_default_bandwidth_share']:.0%})  best {row['kernels_best_us']:8.1f} "
                f"({row['kernels_best_bandwidth_share']:.0%})  gate_up {row['best_gate_up']}  down {row['best_down']}",
                flush=True,
            )
    prefill = []
    for tokens in [int(t) for t in args.prefill_tokens.split(",") if t]:
        row = prefill_case(tokens, gate_up, down_w, k)
        prefill.append(row)
        best = row["kernels_best"]
        print(
            f"prefill {tokens:6d}: grouped_mm {row['grouped_mm_us']:9.1f} us ({row['grouped_mm_tflops']:.0f} TFLOP/s)"
            f"  kernels best {best['us']:9.1f} us ({best['tflops']:.0f}) {best['shape']} err {best['rel_err']:.1e}",
            flush=True,
        )
    if args.out:
        result = {"shape": args.shape, "gpu": torch.cuda.get_device_name(), "rows": rows, "prefill": prefill}
        Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
