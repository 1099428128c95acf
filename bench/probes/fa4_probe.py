"""Probe: flash-attn 4's SM90 forward (CuTe DSL, FA3's Hopper algorithm) over our block-major pool, against our
SDPA path (correctness) and in the same steps and layouts as flashinfer_probe.py (speed), on one layer of the
llama-8b shape. FA4 reads pages through a page table [sequences, pages] and a page stride it takes from the
layer view, so the pool is read in place as FlashInfer reads it. Run after `source bench/fa4_env.sh` (the .fa4
kit); it imports no FlashInfer (FA4 needs a newer tvm-ffi than the FlashInfer kit's), so compare its table
with flashinfer_probe.py's, run in the same call.

Prints one line per check, a table, 'PASS' or 'FAIL: <reason>' last; writes JSON to --out (or $OUT).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "probes"))

from flashinfer_probe import (  # noqa: E402
    CORRECTNESS,
    DTYPE,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    LAYOUTS,
    TIMED,
    attention_flops,
    check,
    relative_error,
    run,
    run_stages,
    step,
    time_ms,
)

from rank_worker.model.attention.fa4_backend import Fa4Attention, run_fa4  # noqa: E402
from rank_worker.model.attention.sdpa_backend import SdpaAttention  # noqa: E402
from rank_worker.model.attention.triton_backend import attend_decodes  # noqa: E402

COLD = [(8192, 0), (32768, 0)]  # chunks with nothing cached: today's flash SDPA against FA4 over the pool


def fa4_run(q, layer, batch, **options) -> torch.Tensor:
    """The engine's Fa4Attention for a step (its plan; run_fa4 with options), decodes by our kernel."""
    backend = Fa4Attention(DTYPE, HEADS // KV_HEADS)
    backend.plan(batch)
    out = torch.zeros_like(q)
    attend_decodes(q, layer[:, 0], layer[:, 1], batch, HEAD_DIM**-0.5, out)
    run_fa4(q, layer[:, 0], layer[:, 1], batch.attention, HEAD_DIM**-0.5, out, **options)
    return out


def correctness() -> list[dict]:
    rows = []
    for name, (decodes, chunks) in CORRECTNESS.items():
        torch.manual_seed(len(rows))
        q, k, v, layer, batch = step(decodes, chunks)
        started = time.perf_counter()
        ours = fa4_run(q, layer, batch)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - started
        reference = run(SdpaAttention(), q, k, v, layer, batch)
        error = relative_error(ours, reference)
        row = {"case": name, "rel_error": round(error, 5), "first_call_s": round(first_s, 3)}
        rows.append(row)
        print("correctness", row, flush=True)
        check(not ours.isnan().any(), f"{name}: NaN in FA4 output")
        check(error < 1e-2, f"{name}: relative error {error:.4g} against SDPA (limit 1e-2)")
    return rows


def time_fa4_ms(q, layer, batch, **options) -> float:
    backend = Fa4Attention(DTYPE, HEADS // KV_HEADS)
    backend.plan(batch)
    out = torch.empty_like(q)
    args = (q, layer[:, 0], layer[:, 1], batch.attention, HEAD_DIM**-0.5, out)
    run_fa4(*args, **options)  # compile outside the timing
    return time_ms(lambda: run_fa4(*args, **options))


def timing() -> list[dict]:
    """FA4 over each layout of LAYOUTS for the warm steps; FA4 against flash SDPA for cold chunks."""
    rows = []
    for new, cached in TIMED + COLD:
        row: dict = {"new": new, "cached": cached}
        for name, layers, block, scattered in LAYOUTS if cached else LAYOUTS[:1]:
            torch.manual_seed(new)
            q, k, v, layer, batch = step([], [(new, cached)], layers, block, scattered)
            ms = time_fa4_ms(q, layer, batch)
            row[f"fa4_{name}_ms"] = round(ms, 3)
            row[f"fa4_{name}_tflops"] = round(attention_flops(new, cached) / ms / 1e9, 1)
            if name == "engine":
                for label, options in (("pack_gqa", {"pack_gqa": True}), ("no_pack_gqa", {"pack_gqa": False})):
                    ms = time_fa4_ms(q, layer, batch, **options)
                    row[f"fa4_{name}_{label}_ms"] = round(ms, 3)
                if not cached:
                    from rank_worker.model.attention.sdpa_backend import causal_sdpa

                    ms = time_ms(lambda q=q, k=k, v=v: causal_sdpa(q, k, v, HEAD_DIM**-0.5))
                    row["sdpa_ms"] = round(ms, 3)
                    row["sdpa_tflops"] = round(attention_flops(new, cached) / ms / 1e9, 1)
            del q, k, v, layer, batch
            torch.cuda.empty_cache()
        rows.append(row)
        print("timing", row, flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    out = os.path.join(os.environ["OUT"], "fa4_probe.json") if "OUT" in os.environ else ""
    parser.add_argument("--out", default=out)
    args = parser.parse_args()
    result: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}

    def imported() -> float:
        started = time.perf_counter()
        import flash_attn.cute  # noqa: F401

        result["heads"] = [HEADS, KV_HEADS, HEAD_DIM, str(DTYPE)]
        return round(time.perf_counter() - started, 2)

    return run_stages(result, [("import_s", imported), ("correctness", correctness), ("timing", timing)], args.out)


if __name__ == "__main__":
    sys.exit(main())
