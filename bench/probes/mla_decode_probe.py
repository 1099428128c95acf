"""The MLA decode kernel (rank_worker/model/attention/mla_decode_kernel.py) over a V2-Lite-shaped latent pool at
decode batch sizes, across launch shapes: microseconds per layer and the share of the H200's ~4.8 TB/s its
latent reads reach. Two stages per batch size: the program's shape (tokens a loop step, warps, pipeline depth)
at the default slicing, then, with the best of those, the slicing (slices a row, the shortest slice) at each
context length (the longer ones only where the batch's latents fit MAX_CASE_TOKENS); the slicing kept is the one
with the best geometric mean over the lengths of its time over that length's best, since one CUDA graph per
batch size serves every length. Every launch is timed as a CUDA graph replay, as the engine runs decode: timed
from Python, a small batch measures the launches (the 2026-12-03 run's b1 picks, made that way, were slower in
the engine). Each shape's output is checked against the default launch's. Prints a table, writes JSON;
--write-launch merges the picks into the kernel's launch table (mla_decode_kernel.LAUNCH_FILE) for this GPU and
shape, where the engine takes them.

    python3 bench/probes/mla_decode_probe.py --out $OUT/mla-decode-probe.json --write-launch
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from rank_worker.model.attention import mla_decode_kernel  # noqa: E402
from rank_worker.model.attention.mla_decode_kernel import mla_decode_attention  # noqa: E402

PEAK_BYTES_S = 4.8e12
BLOCK_SIZE = 16
PROGRAM_SHAPES = [
    {"TILE": t, "num_warps": w, "num_stages": s} for t, w, s in itertools.product((16, 32, 64), (4, 8), (2, 3, 4))
]
SLICE_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
SLICINGS = [{"slices": n, "min_slice": m} for n, m in itertools.product(SLICE_COUNTS, (0, 256))]
MAX_REL_ERR = 1e-2
MAX_CASE_TOKENS = 4 << 20  # a case's latents (4M tokens: 4.8 GB in bf16)
# rows x slices tried: at least about one program a multiprocessor, at most this many partial outputs (16 heads
# x 512 floats each); each graph-timed launch costs ~0.3 s to capture, so the sweep stays at ~2 minutes
MIN_PROGRAMS, MAX_PARTIALS = 128, 16384


def bench_us(fn) -> float:
    """Median microseconds of one call replayed from a CUDA graph (captured after a warm-up call)."""
    import triton

    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3


class Case:
    """One batch of rows of one context length over scattered blocks of a bf16 latent pool."""

    def __init__(self, batch: int, context: int, heads: int, rank: int, rope: int) -> None:
        dev = torch.device("cuda")
        blocks_per_row = context // BLOCK_SIZE
        self.pool = torch.randn(batch * blocks_per_row + 8, BLOCK_SIZE, 1, rank + rope, device=dev).to(torch.bfloat16)
        self.tables = torch.randperm(self.pool.shape[0] - 8, device=dev)[: batch * blocks_per_row].view(batch, -1).int()
        self.rows = torch.arange(batch, device=dev, dtype=torch.int32)
        self.lens = torch.full((batch,), context, device=dev, dtype=torch.int32)
        self.q_lat = torch.randn(batch, heads, rank, device=dev).to(torch.bfloat16)
        self.q_pe = torch.randn(batch, heads, rope, device=dev).to(torch.bfloat16)
        self.scale = (128 + rope) ** -0.5
        self.latent_bytes = batch * context * (rank + rope) * 2
        self.reference = self.run({}).float()

    def run(self, shape: dict) -> torch.Tensor:
        args = (self.q_lat, self.q_pe, self.pool, self.tables, self.rows, self.lens, self.scale)
        return mla_decode_attention(*args, shape)

    def measure(self, shape: dict) -> dict:
        try:
            out = self.run(shape).float()
            err = float((out - self.reference).norm() / self.reference.norm())
            us = bench_us(lambda: self.run(shape))
        except Exception as exc:  # past the shared memory: noted, the sweep goes on
            return {"shape": shape, "error": str(exc)[:200]}
        share = self.latent_bytes / us / 1e-6 / PEAK_BYTES_S
        return {"shape": shape, "us": us, "rel_err": err, "bandwidth_share": share, "ok": err < MAX_REL_ERR}


def fastest(rows: list[dict]) -> dict:
    return min((r for r in rows if r.get("ok")), key=lambda r: r["us"])


def one_batch(batch: int, contexts: list[int], heads: int, rank: int, rope: int) -> dict:
    # the measured table must not steer the sweep's "default" launch: the defaults are the kernel's own
    mla_decode_kernel._measured.cache_clear()
    saved, mla_decode_kernel.LAUNCH_FILE = mla_decode_kernel.LAUNCH_FILE, Path("/nonexistent")
    try:
        contexts = [c for c in contexts if batch * c <= MAX_CASE_TOKENS] or contexts[:1]
        cases = {context: Case(batch, context, heads, rank, rope) for context in contexts}
        first = cases[contexts[0]]
        default_us = {context: bench_us(lambda c=case: c.run({})) for context, case in cases.items()}
        programs = [first.measure(shape) for shape in PROGRAM_SHAPES]
        program = fastest(programs)["shape"]
        slicings = {
            context: [
                case.measure({**program, **s})
                if MIN_PROGRAMS <= batch * s["slices"] <= MAX_PARTIALS
                else {"shape": s, "skipped": True}
                for s in SLICINGS
            ]
            for context, case in cases.items()
        }
    finally:
        mla_decode_kernel.LAUNCH_FILE = saved
        mla_decode_kernel._measured.cache_clear()
    best_at = {context: fastest(rows)["us"] for context, rows in slicings.items()}

    def spread(index: int) -> float:  # geometric mean over the lengths of (time / that length's best)
        rows = [slicings[context][index] for context in contexts]
        if not all(r.get("ok") for r in rows):
            return math.inf
        return math.exp(sum(math.log(r["us"] / best_at[c]) for r, c in zip(rows, contexts, strict=True)) / len(rows))

    pick = min(range(len(SLICINGS)), key=spread)
    chosen = {**program, **SLICINGS[pick]}
    return {
        "batch": batch,
        "contexts": contexts,
        "default_us": default_us,
        "default_bandwidth_share": {c: cases[c].latent_bytes / default_us[c] / 1e-6 / PEAK_BYTES_S for c in contexts},
        "chosen": chosen,
        "chosen_us": {c: slicings[c][pick]["us"] for c in contexts},
        "chosen_bandwidth_share": {c: slicings[c][pick]["bandwidth_share"] for c in contexts},
        "chosen_over_best": spread(pick),
        "programs": programs,
        "slicings": slicings,
    }


def write_launch(path: Path, gpu: str, key: str, rows: list[dict], source: str) -> None:
    table = json.loads(path.read_text()) if path.exists() else {}
    table.setdefault("about", "bench/probes/mla_decode_probe.py --write-launch: launch shapes by batch size")
    table.setdefault("gpus", {}).setdefault(gpu, {})[key] = {str(r["batch"]): r["chosen"] for r in rows}
    table.setdefault("sources", {}).setdefault(gpu, {})[key] = source
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="dsv2-lite-chat")
    parser.add_argument("--batches", default="1,8,16,32,64,128")
    parser.add_argument("--contexts", default="4096,32768,131072")
    parser.add_argument("--out", default="")
    parser.add_argument("--write-launch", action="store_true", help="merge the picks into the kernel's table")
    parser.add_argument("--source", default="", help="what to record as the picks' source (date, commit)")
    args = parser.parse_args()
    cfg = json.loads((ROOT / "bench" / "shapes" / args.shape / "config.json").read_text())
    heads, rank, rope = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        row = one_batch(batch, contexts, heads, rank, rope)
        rows.append(row)
        us, share = row["chosen_us"], row["chosen_bandwidth_share"]
        cells = "  ".join(
            f"{c}: {row['default_us'][c]:7.1f} -> {us[c]:7.1f} us ({share[c]:.0%})" for c in row["contexts"]
        )
        print(f"b{batch:<4d} {cells}  {row['chosen']}", flush=True)
    gpu = torch.cuda.get_device_name()
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "gpu": gpu, "rows": rows}))
    if args.write_launch:
        write_launch(mla_decode_kernel.LAUNCH_FILE, gpu, f"{heads}/{rank}/{rope}", rows, args.source or args.out)
        print(f"wrote {mla_decode_kernel.LAUNCH_FILE}")


if __name__ == "__main__":
    main()
