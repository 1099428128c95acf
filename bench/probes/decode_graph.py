"""Probe: one decode forward of the real model, eager vs replayed from a CUDA graph, at a few batch sizes.

Tells what capturing decode steps would buy before building it into the engine. CUDA only.
    python bench/probes/decode_graph.py --shape llama-8b --out /tmp/probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from loadgen.provenance import checkout_record  # noqa: E402
from rank_worker.engine.factory import build_random_model  # noqa: E402
from rank_worker.engine.model_runner import kv_pool_shape  # noqa: E402
from rank_worker.model.forward_batch import DecodeGroup, ForwardBatch  # noqa: E402


def decode_batch(batch: int, context: int, block_size: int, device: torch.device) -> ForwardBatch:
    blocks = context // block_size
    tables = torch.arange(batch * blocks, device=device).view(batch, blocks)
    positions = torch.full((batch,), context - 1, device=device)
    return ForwardBatch(
        input_ids=torch.randint(0, 1000, (batch,), device=device),
        positions=positions,
        slot_blocks=tables[:, -1].clone(),
        slot_offsets=positions % block_size,
        decode=DecodeGroup(batch, tables, torch.full((batch,), context, device=device), context),
        prefills=[],
        logits_indices=torch.arange(batch, device=device),
    )


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / reps * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    model = build_random_model(str(ROOT / "bench/shapes" / args.shape / "config.json"), 131072)
    block_size = 16
    batches = [int(b) for b in args.batches.split(",")]
    num_blocks = max(batches) * args.context // block_size
    kv = torch.zeros(kv_pool_shape(model, num_blocks, block_size), dtype=torch.bfloat16, device=device)
    rows = []
    with torch.inference_mode():
        for batch in batches:
            forward = decode_batch(batch, args.context, block_size, device)
            eager = timed(lambda forward=forward: model(forward, kv), 20)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(3):
                    model(forward, kv)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = model(forward, kv)
            expected = model(forward, kv)
            graph.replay()
            torch.cuda.synchronize()
            same = bool(torch.allclose(logits, expected, atol=1e-2, rtol=1e-2))
            replay = timed(graph.replay, 50)
            rows.append(
                {
                    "batch": batch,
                    "context": args.context,
                    "eager_ms": round(eager, 3),
                    "graph_ms": round(replay, 3),
                    "speedup": round(eager / replay, 2),
                    "same_logits": same,
                }
            )
            print(rows[-1], flush=True)
            del graph
    if args.out:
        result = {
            "date": time.strftime("%Y-%m-%d"),
            **checkout_record(),
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "shape": args.shape,
            "rows": rows,
        }
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
