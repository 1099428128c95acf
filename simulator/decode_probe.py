"""Decode step time on the GPU against batch AND context: a check of the step-time model's decode assumption
(what a step costs per token of KV, and what rows shorter than the longest cost: with the gather path they
were padded to the longest; with the paged decode kernel they cost their own length). The engine benchmark
(bench/engine.py) measures one context; this measures several, and batches of mixed contexts, and prints
the model's prediction beside each.

Sequences are set up as if their prompt had been prefilled (blocks allocated, nothing computed: decode time
does not depend on the values in the KV), so only decode steps run. Random weights in a real shape.

    python -m simulator.decode_probe --out simulator/results/decode-h200.json     # on the GPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contracts.config import EngineConfig, SchedulingConfig  # noqa: E402
from rank_worker.engine.factory import build_random_model  # noqa: E402
from rank_worker.engine.interface import SamplingParams  # noqa: E402
from rank_worker.engine.paged_engine import EngineSettings, PagedEngine  # noqa: E402
from rank_worker.engine.sequence import Sequence, SequenceStatus  # noqa: E402
from simulator.step_time import fit_step_time, load_engine_results  # noqa: E402

# (decode contexts, prefill chunk as (new tokens, cached tokens) or None)
CASES: list[tuple[list[int], tuple[int, int] | None]] = [
    *[([4096] * b, None) for b in (1, 16, 64, 128)],  # the engine benchmark's points, again
    *[([16384] * b, None) for b in (1, 8, 16, 32)],
    *[([65536] * b, None) for b in (1, 2, 4, 8)],
    ([131072], None),
    ([131072] * 4, None),
    # One long sequence among short ones: does everyone pay for the longest?
    ([65536] + [4096] * 15, None),
    ([131072] + [4096] * 7, None),
    ([16384] + [4096] * 31, None),
    ([65536] + [4096] * 31, None),
    # A prefill chunk alone and with decodes riding along: do their costs add up?
    ([], (8192, 0)),
    ([], (8192, 65536)),
    ([16384] * 16, (8192, 0)),
    ([16384] * 16, (8192, 65536)),
]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _engine(shape: str, num_blocks: int, max_len: int) -> PagedEngine:
    model = build_random_model(str(ROOT / "bench" / "shapes" / shape / "config.json"), max_len)
    # The engine benchmark's chunk size, so a prefill chunk runs whole in one step. Steps one at a time: each is
    # timed alone (synchronised before and after), and a pipelined step would schedule its successor over the
    # sequences this probe sets up by hand, which grow past the blocks it gave them. No decode step budget: on a GPU
    # it would cut the prefill chunk of a case with decoders (the H100's 8K chunk beside 16 decoders ran 18-36 ms).
    settings = EngineSettings(
        num_blocks=num_blocks,
        max_model_len=max_len,
        engine=EngineConfig(max_num_seqs=256, max_num_batched_tokens=32768, pipeline_steps=False),
        scheduling=SchedulingConfig(decode_step_budget_ms=0.0),
    )
    return PagedEngine(model, settings)


def _running(engine: PagedEngine, request_id: str, computed: int, total: int) -> Sequence:
    """A running sequence of `total` tokens whose first `computed` are in the pool (blocks for all of them
    allocated): the next step computes the rest."""
    seq = Sequence(
        request_id=request_id,
        token_ids=[(len(request_id) * 7 + t) % 1000 for t in range(total)],
        num_prompt_tokens=total,
        sampling=SamplingParams(max_tokens=10_000, ignore_eos=True),
        arrival_time=time.monotonic(),
    )
    assert engine.kv.allocate(seq, total), "the pool is too small for this case"
    seq.num_computed_tokens = computed
    seq.num_l0_cached_tokens = computed
    seq.status = SequenceStatus.RUNNING
    engine.scheduler.running.append(seq)
    return seq


def _timed_step(engine: PagedEngine) -> float:
    _sync()
    start = time.perf_counter()
    engine.step()
    _sync()
    return time.perf_counter() - start


def measure(engine: PagedEngine, contexts: list[int], prefill: tuple[int, int] | None, case: int, steps: int) -> float:
    """Median seconds per step of these decodes, plus one prefill chunk (set up again before each step)."""
    seqs = [_running(engine, f"c{case}-{i}", context, context + 1) for i, context in enumerate(contexts)]
    times = []
    for rep in range(steps + 3):  # the first 3 warm up at this shape
        chunk = None
        if prefill is not None:
            new, cached = prefill
            chunk = _running(engine, f"p{case}-{rep}", cached, cached + new)
            engine.scheduler.running.remove(chunk)
            engine.scheduler.running.insert(0, chunk)  # scheduled first: it gets its whole chunk
        seconds = _timed_step(engine)
        if rep >= 3:
            times.append(seconds)
        if chunk is not None:
            _drop(engine, chunk)
    for seq in seqs:
        _drop(engine, seq)
    return statistics.median(times)


def _drop(engine: PagedEngine, seq: Sequence) -> None:
    """A case's sequence gone: out of the scheduler, and its block-table row free again (the engine frees a
    finished one's row; without this the cases after ~256 sequences found none)."""
    engine.scheduler.remove(seq)
    engine.runner.release(seq)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--engine-results", default=str(ROOT / "simulator" / "results" / "engine-h200.json"))
    parser.add_argument("--num-blocks", type=int, default=40_000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="tiny cases (a CPU smoke run of the script)")
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    quick: list[tuple[list[int], tuple[int, int] | None]] = [([64] * 2, None), ([256] + [64] * 3, None)]
    cases = [*quick, ([64], (128, 256))] if args.quick else CASES
    model = fit_step_time(load_engine_results(args.engine_results))
    engine = _engine(
        args.shape, args.num_blocks, max(max(c, default=0) + (p[0] + p[1] if p else 0) for c, p in cases) + 64
    )
    rows = []
    block_size = engine.kv.block_size
    for case, (contexts, prefill) in enumerate(cases):
        # blocks the case takes at its longest (every decode step adds a token), and a prefill chunk's own
        needed = sum(-(-(c + args.steps + 4) // block_size) for c in contexts)
        needed += -(-(prefill[0] + prefill[1]) // block_size) if prefill else 0
        if needed > engine.kv.pool.num_free:
            print(f"skipped: {len(contexts)} x {max(contexts, default=0)} tokens (+ {prefill}) needs {needed} "
                  f"blocks of a {args.num_blocks}-block pool", flush=True)  # fmt: skip
            continue
        seconds = measure(engine, contexts, prefill, case, args.steps)
        # Decode contexts as the simulator counts them: the token being decoded included.
        predicted = model.step_s([prefill] if prefill else [], [c + 1 for c in contexts])
        row = {
            "batch": len(contexts),
            "max_context": max(contexts, default=0),
            "kv_tokens": sum(contexts),
            "padded_kv_tokens": len(contexts) * max(contexts, default=0),
            "prefill_new": prefill[0] if prefill else 0,
            "prefill_cached": prefill[1] if prefill else 0,
            "step_ms": round(seconds * 1e3, 3),
            "model_ms": round(predicted * 1e3, 3),
            "ratio": round(predicted / seconds, 3),
        }
        rows.append(row)
        print(row, flush=True)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "shape": args.shape,
        "engine_results": args.engine_results,
        "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
