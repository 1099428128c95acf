"""Where a decode step's GPU time goes (and a cold prefill's), kernel by kernel, for one shape: the engine the
rank worker serves (build_engine) without CUDA graphs (so the profiler sees each kernel), `batch` sequences of
`context` tokens stepped `steps` times under torch.profiler, then one cold prefill of `prefill` tokens.
Prints the top kernels by CUDA time per phase and writes them as JSON; for a MoE model also how many distinct
routed experts each MoE layer's decode step hit (what the step must read of the experts' weights).

    python3 bench/probes/decode_profile.py --shape dsv2-lite-chat --batch 16 --out $OUT/decode-profile.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.engine import Bench, sync  # noqa: E402
from contracts.config import load_config  # noqa: E402
from rank_worker.engine.factory import build_engine  # noqa: E402

CUDA = torch.cuda.is_available()
# Kernels on a GPU; on the CPU (a smoke run of the script) its ops' own time.
ACTIVITIES = [torch.profiler.ProfilerActivity.CUDA if CUDA else torch.profiler.ProfilerActivity.CPU]


def top_kernels(prof: torch.profiler.profile, per: int, limit: int = 25) -> list[dict]:
    rows = []
    for event in prof.key_averages():
        us = event.device_time_total if CUDA else event.self_cpu_time_total
        if us <= 0 or event.key.startswith(("cudaGraph", "ProfilerStep")):
            continue
        rows.append({"kernel": event.key[:120], "calls": event.count // per, "us_per_unit": us / per})
    rows.sort(key=lambda r: -r["us_per_unit"])
    return rows[:limit]


def experts_hit(engine) -> list[int]:
    """Distinct routed experts each MoE layer's gate chose over one decode step (empty for a dense model)."""
    from rank_worker.model.moe import MoE

    hit: list[int] = []

    def count(router, _inputs, out) -> None:  # the gate's ids carry the shared experts' slots too: not counted
        ids = out[0]
        hit.append(int(torch.unique(ids[ids < router.cfg.n_routed_experts]).numel()))

    hooks = [module.gate.register_forward_hook(count) for module in engine.model.modules() if isinstance(module, MoE)]
    try:
        engine.step()
    finally:
        for hook in hooks:
            hook.remove()
    return hit


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="dsv2-lite-chat")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--prefill", type=int, default=8192)
    parser.add_argument("--random-weights", default="normal", choices=["normal", "uniform"])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    config = load_config(
        model=str(ROOT / "bench" / "shapes" / args.shape / "config.json"),
        load_format="dummy",
        random_weights=args.random_weights,
        max_num_seqs=256,
        cuda_graphs=False,
        max_model_len=max(args.context, args.prefill) + args.steps + 64,
    )
    engine = build_engine(config)
    bench = Bench(engine, json.loads((ROOT / "bench" / "shapes" / args.shape / "config.json").read_text()))
    prompts = [bench.prompt(args.context) for _ in range(args.batch)]
    bench.run(prompts, 1)  # cached
    bench.run(prompts, 2)  # warm-up
    result: dict = {
        "shape": args.shape,
        "batch": args.batch,
        "context": args.context,
        "random_weights": args.random_weights,
    }
    for rid_prompt in prompts:
        bench.request(rid_prompt, args.steps + 8)
    for _ in range(4):  # past the prefill of the last blocks
        engine.step()
    sync()
    result["experts_hit_per_layer"] = experts_hit(engine)
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    bench.drain()
    result["decode"] = top_kernels(prof, args.steps)
    result["decode_step_us"] = sum(r["us_per_unit"] for r in top_kernels(prof, args.steps, 10_000))
    cold = bench.prompt(args.prefill)
    bench.run([bench.prompt(args.prefill)], 1)
    with torch.profiler.profile(activities=ACTIVITIES) as prof:
        bench.run([cold], 1)
    result["prefill"] = top_kernels(prof, 1)
    result["prefill_us"] = sum(r["us_per_unit"] for r in top_kernels(prof, 1, 10_000))
    if result["experts_hit_per_layer"]:
        hits = result["experts_hit_per_layer"]
        print(f"experts hit per MoE layer in a decode step of {args.batch}: mean {sum(hits) / len(hits):.1f}, {hits}")
    for phase in ("decode", "prefill"):
        total = result[f"{phase}_step_us" if phase == "decode" else "prefill_us"]
        print(f"--- {phase}: {total:.0f} us of kernels per {'step' if phase == 'decode' else 'prefill'}")
        for row in result[phase]:
            print(f"{row['us_per_unit']:10.1f} us {row['calls']:5d}x  {row['kernel']}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
