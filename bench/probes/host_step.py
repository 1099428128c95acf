"""Probe: the engine's host time per decode step, with the model taken out.

On the GPU a decode step is a graph replay plus this host work (scheduling, the step's inputs, the block
table, sampling's bookkeeping, the outputs), and the two do not overlap: the tokens are read back before
the next step is scheduled. So this host time is part of every decode step's time, and it grows with the
rows. Here the model is a stand-in that returns logits at once, the decode graphs run uncaptured (the same
padded-input path as a replay), and what is left is the engine's own Python: its CPU time (not wall time,
so a shared machine's other work does not count), best of several repeats. Runs on the CPU.

    python bench/probes/host_step.py --out host-step.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from contracts.config import load_config  # noqa: E402
from rank_worker.engine.decode_graphs import DecodeGraphs  # noqa: E402
from rank_worker.engine.factory import build_engine  # noqa: E402
from rank_worker.engine.interface import EngineRequest, SamplingParams  # noqa: E402

VOCAB = 8  # the stand-in's logits: sampling's cost does not depend on the vocabulary's size here
TINY = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}


class InstantModel(torch.nn.Module):
    """Logits at once: what is timed is everything around the model."""

    def __init__(self) -> None:
        super().__init__()
        self.cfg = types.SimpleNamespace(vocab_size=VOCAB)

    def forward(self, batch, kv_cache):  # type: ignore[no-untyped-def]
        return torch.zeros(batch.logits_indices.shape[0], VOCAB)


def host_step_ms(batch: int, steps: int, repeats: int, context: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(TINY))
        config = load_config(
            model=str(path), load_format="dummy", dtype="float32", max_num_seqs=max(batch, 8), max_model_len=8192
        )
        engine = build_engine(config)
    runner = engine.runner
    runner.model = InstantModel()
    runner.decode_graphs = DecodeGraphs(runner.model, engine.kv_cache, runner.inputs, max(batch, 8), capture=False)
    gen = torch.Generator().manual_seed(batch)
    total = steps * repeats + 16
    for i in range(batch):
        prompt = torch.randint(0, TINY["vocab_size"], (context,), generator=gen).tolist()
        engine.add_request(EngineRequest(f"r{i}", prompt, SamplingParams(max_tokens=total, ignore_eos=True)))
    while len(engine.step()) < batch:  # every row past its prefill
        pass
    for _ in range(5):
        engine.step()
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()  # CPU time, not wall: a busy machine's other work is not counted
        for _ in range(steps):
            engine.step()
        best = min(best, (time.process_time() - start) / steps)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,16,64,128")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        ms = host_step_ms(batch, args.steps, args.repeats, args.context)
        rows.append({"batch": batch, "host_ms_per_step": round(ms, 4), "host_us_per_row": round(ms * 1e3 / batch, 2)})
        print(f"batch {batch:4d}: {ms:.3f} ms host per decode step ({ms * 1e3 / batch:.1f} us a row)", flush=True)
    write_rows(args.out, "host_step", rows)


def write_rows(out: str, probe: str, rows: list[dict]) -> None:
    """A CPU probe's result file (nothing without --out)."""
    if out:
        result = {"probe": probe, "cpu": platform.processor() or platform.machine(), "rows": rows}
        Path(out).write_text(json.dumps(result, indent=2) + "\n")
        print("wrote", out)


if __name__ == "__main__":
    main()
