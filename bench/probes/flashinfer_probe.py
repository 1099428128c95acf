"""Probe: FlashInfer's FA3 paged prefill (FlashInferAttention) on the H200 against our SDPA path (correctness)
and our Triton backend (speed), on one layer of the llama-8b shape (32 query heads, 8 kv heads, head_dim 128,
bf16) over a scattered pool with the engine's block stride. FlashInfer must load its module prebuilt (.fi/):
run through bench/probes/flashinfer_check.sh, which installs the wheels and sets the environment.

Prints one line per check, a table, 'PASS' or 'FAIL: <reason>' last; writes JSON to --out (or $OUT).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rank_worker.model.attention.flashinfer_backend import FlashInferAttention  # noqa: E402
from rank_worker.model.attention.sdpa_backend import SdpaAttention  # noqa: E402
from rank_worker.model.attention.triton_backend import TritonAttention  # noqa: E402
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
LAYERS, LAYER = 32, 5  # the engine's pool: a block holds every layer, so a layer's view strides over 32
DTYPE = torch.bfloat16
DEV = torch.device("cuda")
MODULE_ARGS = ("fa3", DTYPE, DTYPE, DTYPE, torch.int32, HEAD_DIM, HEAD_DIM, 0, False, False, False)
TIMED = [(8192, 32768), (4096, 100000), (1024, 32768)]  # (new, cached): bench/probes/attention_kernels.py


class ProbeFailure(Exception):
    pass


def check(condition: bool, reason: str) -> None:
    if not condition:
        raise ProbeFailure(reason)


def prebuilt_module() -> dict:
    """FlashInfer finds the FA3 module in the prebuilt cache (is_aot) and never spawns a compiler."""
    started = time.perf_counter()
    import flashinfer
    from flashinfer.jit import env as jit_env
    from flashinfer.jit.attention.modules import gen_batch_prefill_module
    from flashinfer.prefill import get_batch_prefill_module

    import_s = time.perf_counter() - started
    spec = gen_batch_prefill_module(*MODULE_ARGS)
    check(spec.is_aot, f"FA3 module not found prebuilt at {spec.aot_path}: FlashInfer would compile it")
    started = time.perf_counter()
    get_batch_prefill_module(*MODULE_ARGS)  # what the wrapper's first plan calls: load, or JIT if not prebuilt
    load_s = time.perf_counter() - started
    info = {
        "flashinfer": flashinfer.__version__,
        "import_s": round(import_s, 2),
        "aot_dir": str(jit_env.FLASHINFER_AOT_DIR),
        "module": spec.name,
        "prebuilt": spec.is_aot,
        "module_first_load_s": round(load_s, 3),
        "jit_disabled": bool(os.environ.get("FLASHINFER_DISABLE_JIT")),
        "torch_native_dlpack_exchange": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
    }
    print("module", info, flush=True)
    return info


def scattered_pool(
    lengths: list[int], layers: int = LAYERS, block: int = BLOCK, scattered: bool = True
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A pool [blocks, layers, 2, block, Hkv, D] (only one layer filled) and a block table whose rows, placed
    out of order, hold scattered blocks (never block 0). layers=1: a pool of one layer, each block's K/V
    64 KB apart instead of the engine's 2 MB (the layout question of layouts()); scattered=False: each row's
    blocks in ascending order, as a fresh pool's free list hands them out."""
    blocks = sum(-(-n // block) for n in lengths) + 8
    pool = torch.empty(blocks, layers, 2, block, KV_HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    pool[:, min(LAYER, layers - 1)].normal_()
    order = ((torch.randperm(blocks - 1) if scattered else torch.arange(blocks - 1)) + 1).tolist()
    width = max(-(-n // block) for n in lengths) + 3
    rows = torch.randperm(len(lengths) + 2)[: len(lengths)].tolist()
    table = torch.zeros(len(lengths) + 2, width, dtype=torch.int32)
    used = 0
    for row, n in zip(rows, lengths, strict=True):
        count = -(-n // block)
        table[row, :count] = torch.tensor(order[used : used + count])
        used += count
    return pool, table.to(DEV), rows


def step(
    decodes: list[int], chunks: list[tuple[int, int]], layers: int = LAYERS, block: int = BLOCK, scattered: bool = True
) -> tuple:
    """One step: decode rows, then adjacent chunks (new, cached); q is a strided view of a qkv buffer as the
    model passes it; the chunks' own K/V are read back from the pool (the fused rotary kernel stored them)."""
    lengths = decodes + [new + cached for new, cached in chunks]
    pool, table, rows = scattered_pool(lengths, layers, block, scattered)
    layer = pool[:, min(LAYER, layers - 1)]
    total = len(decodes) + sum(new for new, _ in chunks)
    pieces, cursor = [], len(decodes)
    for (new, cached), row in zip(chunks, rows[len(decodes) :], strict=True):
        pieces.append(PrefillSlice(cursor, new, cached + new, row))
        cursor += new
    zeros = torch.zeros(total, dtype=torch.long, device=DEV)
    batch = ForwardBatch(
        zeros,
        zeros,
        zeros,
        zeros,
        zeros[:0],
        table,
        num_decodes=len(decodes),
        decode_rows=torch.tensor(rows[: len(decodes)], device=DEV),
        decode_lens=torch.tensor(decodes, device=DEV, dtype=torch.long),
        prefills=pieces,
    )
    qkv = torch.randn(total, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=DEV, dtype=DTYPE)
    q = qkv[:, : HEADS * HEAD_DIM].view(total, HEADS, HEAD_DIM)
    k = torch.empty(total, KV_HEADS, HEAD_DIM, device=DEV, dtype=DTYPE)
    v = torch.empty_like(k)
    for piece in pieces:
        blocks = table[piece.table_row].long()
        tokens = torch.arange(piece.context_len - piece.num_new, piece.context_len, device=DEV)
        at = slice(piece.token_start, piece.token_start + piece.num_new)
        k[at] = layer[:, 0][blocks[tokens // block], tokens % block]
        v[at] = layer[:, 1][blocks[tokens // block], tokens % block]
    return q, k, v, layer, batch


def run(backend, q, k, v, layer, batch) -> torch.Tensor:
    backend.plan(batch)
    return backend.attend(q, k, v, layer[:, 0], layer[:, 1], batch, HEAD_DIM**-0.5)


def relative_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    return float((out.float() - reference.float()).norm() / reference.float().norm())


CORRECTNESS = {
    # every chunk shape the scheduler makes: cold first (SDPA), warm over a long prefix, a chunk off a tile
    # boundary, a 2-token chunk, a context ending on a block boundary (last page full), a cold chunk between
    # warm ones (joins the FlashInfer launch), a 1-token warm chunk
    "mixed": ([33, 700, 1], [(300, 0), (129, 2000), (2, 77), (1000, 1000), (50, 0), (64, 15), (1, 500)]),
    "one_warm": ([], [(517, 3001)]),
    "warm_only_prefix_block": ([], [(16, 16), (3, 1)]),
    "cold_only": ([5], [(200, 0), (31, 0)]),
}


def correctness() -> list[dict]:
    rows = []
    for name, (decodes, chunks) in CORRECTNESS.items():
        torch.manual_seed(len(rows))
        q, k, v, layer, batch = step(decodes, chunks)
        started = time.perf_counter()
        backend = FlashInferAttention(DTYPE, HEADS // KV_HEADS)
        ours = run(backend, q, k, v, layer, batch)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - started
        warm = any(new > 0 and cached > 0 for new, cached in chunks)
        check(warm == (backend._holds is not None), f"{name}: FlashInfer ran {backend._holds is not None}, warm {warm}")
        reference = run(SdpaAttention(), q, k, v, layer, batch)
        error = relative_error(ours, reference)
        row = {"case": name, "flashinfer_ran": warm, "rel_error": round(error, 5), "first_call_s": round(first_s, 3)}
        rows.append(row)
        print("correctness", row, flush=True)
        check(not ours.isnan().any(), f"{name}: NaN in FlashInfer output")
        check(error < 1e-2, f"{name}: relative error {error:.4g} against SDPA (limit 1e-2)")
    return rows


def time_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def attention_flops(new: int, cached: int) -> float:
    return 4 * HEADS * HEAD_DIM * new * (cached + new / 2)


def time_layer_ms(backend, q, k, v, layer, batch) -> float:
    """One layer's attend after the step's plan (the first attend of a step plans, the others reuse it)."""
    return time_ms(lambda: backend.attend(q, k, v, layer[:, 0], layer[:, 1], batch, HEAD_DIM**-0.5))


def timing() -> list[dict]:
    rows = []
    for new, cached in TIMED:
        torch.manual_seed(new)
        q, k, v, layer, batch = step([], [(new, cached)])
        row: dict = {"new": new, "cached": cached}
        outputs = {}
        for backend in (FlashInferAttention(DTYPE, HEADS // KV_HEADS), TritonAttention(DTYPE, HEADS // KV_HEADS)):
            outputs[backend.name] = run(backend, q, k, v, layer, batch)
            ms = time_layer_ms(backend, q, k, v, layer, batch)
            row[f"{backend.name}_ms"] = round(ms, 3)
            row[f"{backend.name}_tflops"] = round(attention_flops(new, cached) / ms / 1e9, 1)
        flashinfer = FlashInferAttention(DTYPE, HEADS // KV_HEADS)
        run(flashinfer, q, k, v, layer, batch)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(10):  # a step's first layer: our plan, FlashInfer's plan and the layer's attention
            run(flashinfer, q, k, v, layer, batch)
        torch.cuda.synchronize()
        row["flashinfer_first_layer_ms"] = round((time.perf_counter() - started) * 100, 3)
        row["rel_error_vs_triton"] = round(relative_error(outputs["flashinfer"], outputs["triton"]), 5)
        # The engine's pool puts every layer of a block together (one copy moves a block to L1), so a layer's
        # pages lie 2 MB apart; vLLM's per-layer caches put them 64 KB apart. The same step over a one-layer
        # pool says what that stride costs FA3 (TLB reach, DRAM locality).
        del q, k, v, layer
        torch.manual_seed(new)
        q, k, v, layer, batch = step([], [(new, cached)], layers=1)
        contiguous = FlashInferAttention(DTYPE, HEADS // KV_HEADS)
        run(contiguous, q, k, v, layer, batch)
        row["flashinfer_one_layer_pool_ms"] = round(time_layer_ms(contiguous, q, k, v, layer, batch), 3)
        del q, k, v, layer
        rows.append(row)
        print("timing", row, flush=True)
        check(row["rel_error_vs_triton"] < 1e-2, f"{new} over {cached}: FlashInfer and Triton disagree")
    return rows


# (name, layers in the pool, block size, scattered): the engine's layout first. What each says: layers=1 is
# vLLM's per-layer cache (a layer's pages 64 KB apart, not 2 MB); scattered=False is blocks in order; a
# larger block is fewer, larger pages for the same tokens (fewer TLB entries and index loads).
LAYOUTS = [
    ("engine", LAYERS, 16, True),
    ("engine_in_order", LAYERS, 16, False),
    ("one_layer", 1, 16, True),
    ("one_layer_in_order", 1, 16, False),
    ("engine_block32", LAYERS, 32, True),
    ("engine_block64", LAYERS, 64, True),
    ("one_layer_block64", 1, 64, True),
]


def layouts() -> list[dict]:
    """FA3's time for the timed steps over each pool layout of LAYOUTS (ms, and TFLOP/s of attention)."""
    rows = []
    for new, cached in TIMED:
        row: dict = {"new": new, "cached": cached}
        for name, layers, block, scattered in LAYOUTS:
            torch.manual_seed(new)
            q, k, v, layer, batch = step([], [(new, cached)], layers, block, scattered)
            backend = FlashInferAttention(DTYPE, HEADS // KV_HEADS)
            run(backend, q, k, v, layer, batch)
            ms = time_layer_ms(backend, q, k, v, layer, batch)
            row[f"{name}_ms"] = round(ms, 3)
            row[f"{name}_tflops"] = round(attention_flops(new, cached) / ms / 1e9, 1)
            del q, k, v, layer, batch
            torch.cuda.empty_cache()
        rows.append(row)
        print("layouts", row, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["new    cached   flashinfer ms (TFLOP/s)   triton ms (TFLOP/s)   speed-up   flashinfer, 1-layer pool ms"]
    for r in rows:
        lines.append(
            f"{r['new']:<6} {r['cached']:<8} {r['flashinfer_ms']:>8.3f} ({r['flashinfer_tflops']:>6.1f})"
            f"        {r['triton_ms']:>8.3f} ({r['triton_tflops']:>6.1f})"
            f"     {r['triton_ms'] / r['flashinfer_ms']:.2f}x      {r['flashinfer_one_layer_pool_ms']:>8.3f}"
        )
    return "\n".join(lines)


def run_stages(result: dict, stages: list[tuple[str, object]], out: str) -> int:
    """Run each (name, fn) stage, its return value stored under its name (a stage named with a leading '_'
    is run for its checks only); the first failure is the status, 'FAIL: <stage>: <why>', else PASS. Writes
    result as JSON to out (when given), prints the status; returns the exit code."""
    stage = "setup"
    try:
        check(torch.cuda.is_available(), "no CUDA device")
        for stage, fn in stages:
            value = fn()
            if not stage.startswith("_"):
                result[stage] = value
        result["status"] = "PASS"
    except ProbeFailure as failure:
        result["status"] = f"FAIL: {stage}: {failure}"
    except Exception as exc:  # an import or kernel error is a result too: say where and what
        traceback.print_exc()
        result["status"] = f"FAIL: {stage}: {type(exc).__name__}: {str(exc)[:800]}"
    if out:
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
    print(result["status"], flush=True)
    return 0 if result["status"] == "PASS" else 1


def main() -> int:
    parser = argparse.ArgumentParser()
    out = os.path.join(os.environ["OUT"], "flashinfer_probe.json") if "OUT" in os.environ else ""
    parser.add_argument("--out", default=out)
    args = parser.parse_args()
    result: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}

    def timed() -> list[dict]:
        rows = timing()
        print(table(rows), flush=True)
        return rows

    stages = [("module", prebuilt_module), ("correctness", correctness), ("timing", timed), ("layouts", layouts)]
    return run_stages(result, stages, args.out)


if __name__ == "__main__":
    sys.exit(main())
