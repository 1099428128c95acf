"""Probe: what a step that carries a prefill chunk costs beside decoding rows, against the same chunk alone and
the decode step alone, through the engine the rank serves with (llama-8b shape, random weights, bf16), and
where the time of a mixed step goes (torch.profiler: CUDA kernels against host time).

The agent benchmark's rank log showed mixed steps of 45-75 ms carrying 400-1300 prefill tokens, which a
cold 8K prefill does at ~27 us a token: this probe says whether a mixed step costs decode + chunk, or more,
and for which chunk shapes (one cold chunk, many small ones, a warm one over a long prefix).

    python bench/probes/mixed_steps.py --out bench/results/2026-12-01-h200-mixed-steps/mixed-steps.json   # on the H200
    python bench/probes/mixed_steps.py --shape tiny --quick                                        # smoke run here
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from contracts.config import load_config  # noqa: E402
from rank_worker.engine.factory import build_engine  # noqa: E402
from rank_worker.engine.interface import EngineRequest, SamplingParams  # noqa: E402
from rank_worker.engine.paged_engine import PagedEngine  # noqa: E402

ENDLESS = 1 << 20  # decoders' max_tokens: they outlive the probe and are aborted at the end


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Probe:
    def __init__(self, engine: PagedEngine, vocab: int) -> None:
        self.engine = engine
        self.vocab = vocab
        self.gen = torch.Generator().manual_seed(0)
        self.count = 0
        self.decoders: list[str] = []

    def prompt(self, n: int) -> list[int]:
        return torch.randint(0, self.vocab, (n,), generator=self.gen).tolist()

    def add(self, prompt: list[int], max_tokens: int) -> str:
        self.count += 1
        rid = f"p{self.count}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(EngineRequest(rid, prompt, params))
        return rid

    def timed_step(self) -> tuple[float, int, int]:
        sync()
        start = time.perf_counter()
        self.engine.step()
        sync()
        total, prefill = self.engine.last_step_tokens()
        return time.perf_counter() - start, total, prefill

    def settle(self, limit: int = 100_000) -> None:
        """Step until a step carries no prefill (every decoder primed, every probe request gone)."""
        for _ in range(limit):
            _, total, prefill = self.timed_step()
            if prefill == 0 and total == len(self.decoders):
                return
        raise RuntimeError("the engine did not settle")

    def set_decoders(self, count: int, context: int | list[int]) -> None:
        for rid in self.decoders:
            self.engine.abort_request(rid)
        contexts = context if isinstance(context, list) else [context] * count
        self.decoders = [self.add(self.prompt(n), ENDLESS) for n in contexts]
        self.settle()

    def decode_step_s(self, steps: int) -> float:
        return statistics.median(self.timed_step()[0] for _ in range(steps))

    def add_chunks(self, chunks: list[int], cached: int) -> None:
        """Requests whose next step carries `chunks` (new tokens each), over freshly primed prefixes of `cached`
        tokens when cached > 0; each ends with that step (one output token)."""
        prefixes = [self.prompt(cached) for _ in chunks] if cached else [[] for _ in chunks]
        for prefix in prefixes:
            if prefix:
                self.add(prefix, 1)
        if cached:
            self.settle()
        for prefix, n in zip(prefixes, chunks, strict=True):
            self.add(prefix + self.prompt(n), 1)

    def chunk_step_s(self, chunks: list[int], cached: int, repeats: int) -> dict:
        """Seconds of the step that carries `chunks` (new tokens each; over a primed prefix of `cached` tokens
        when cached > 0), median over repeats; the chunks' prompts end in that step (one output token)."""
        samples, carried = [], []
        for _ in range(repeats):
            self.add_chunks(chunks, cached)
            seconds, _, prefill = self.timed_step()
            samples.append(seconds)
            carried.append(prefill)
            self.settle()
        return {"seconds": statistics.median(samples), "prefill_tokens": statistics.median(carried)}


def profile_step(probe: Probe, chunks: list[int], cached: int, rows: int) -> dict:
    """One mixed step under torch.profiler: its wall time, the CUDA kernels' summed time, and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    probe.add_chunks(chunks, cached)
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        seconds, _, prefill = probe.timed_step()
    probe.settle()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    kernel_us = sum(e.self_device_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_device_time_total, reverse=True)[:rows]
    return {
        "chunks": chunks,
        "cached": cached,
        "wall_s": seconds,
        "prefill_tokens": prefill,
        "kernel_s": kernel_us / 1e6,
        "kernels": [
            {"name": e.key[:90], "calls": e.count, "ms": round(e.self_device_time_total / 1e3, 3)} for e in top
        ],
        "table": prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--backend", default="auto", choices=["auto", "triton", "fa4", "flashinfer", "sdpa"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default="")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--only-decode", action="store_true", help="just the decode-only steps (no mixed ones)")
    parser.add_argument(
        "--decode-programs", type=int, default=0, help="the decode kernel's TARGET_PROGRAMS for this run (0: its own)"
    )
    args = parser.parse_args()

    quick = args.quick
    context = 256 if quick else 4096
    decoder_counts = [0, 4] if quick else [0, 32, 64]
    cold = [32, 64] if quick else [256, 1024, 2048, 4096, 8192]
    many = [(4, 32)] if quick else [(4, 256), (16, 256), (8, 512)]
    warm = [(64, 256)] if quick else [(1024, 16384), (256, 16384), (2048, 32768)]
    repeats = 1 if quick else 3
    config = load_config(
        model=str(ROOT / "bench" / "shapes" / args.shape / "config.json"),
        load_format="dummy",
        max_num_batched_tokens=16384,
        max_num_seqs=256,
        max_model_len=40_000 if not quick else 2048,
        decode_step_budget_ms=0,  # every chunk whole: the probe decides what a step carries
        attention_backend=args.backend,
    )
    if args.decode_programs:
        from rank_worker.model.attention import decode_kernel

        decode_kernel.TARGET_PROGRAMS = args.decode_programs  # read when the graphs are recorded, below
    t0 = time.perf_counter()
    engine = build_engine(config)
    print(f"engine up in {time.perf_counter() - t0:.1f} s, backend {engine.attention.name}", flush=True)
    probe = Probe(engine, engine.model.cfg.vocab_size)
    probe.set_decoders(0, context)
    probe.chunk_step_s([cold[0]], 0, 1)  # warm-up

    rows = []
    for decoders in [] if args.only_decode else decoder_counts:
        probe.set_decoders(decoders, context)
        decode_s = probe.decode_step_s(20) if decoders else 0.0
        cases = [([n], 0) for n in cold] + [([n] * k, 0) for k, n in many] + [([n], c) for n, c in warm]
        for chunks, cached in cases:
            measured = probe.chunk_step_s(chunks, cached, repeats)
            row = {
                "decoders": decoders,
                "context": context,
                "chunks": chunks,
                "cached": cached,
                "decode_step_s": decode_s,
                **measured,
            }
            rows.append(row)
            shown = chunks if len(chunks) < 3 else f"{len(chunks)}x{chunks[0]}"
            print(
                f"decoders {decoders:3d} x {context}: chunks {shown}"
                f" over {cached}: step {measured['seconds'] * 1e3:8.2f} ms (decode alone {decode_s * 1e3:6.2f} ms)",
                flush=True,
            )
    # The extra a mixed step costs: its time less the decode step and the same chunks alone.
    alone = {(tuple(r["chunks"]), r["cached"]): r["seconds"] for r in rows if r["decoders"] == 0}
    for r in rows:
        base = alone.get((tuple(r["chunks"]), r["cached"]))
        if r["decoders"] and base is not None:
            r["extra_s"] = r["seconds"] - base - r["decode_step_s"]

    # Decode-only steps over long and uneven contexts (the agents' regime), against HBM bandwidth.
    decode_rows = []
    cfg = engine.model.cfg
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * engine.kv_cache.element_size()
    weight_bytes = (cfg.num_params_excluding_embeddings + cfg.vocab_size * cfg.hidden_size) * 2
    long_cases = [[512] * 4] if quick else [[16384] * 32, [2048 + 352 * i for i in range(64)]]
    if args.only_decode and not quick:  # uneven as the agents' sessions are, and the engine bench's 4K rows
        long_cases += [[1024 + (i * 7919) % 30000 for i in range(48)], [4096] * 16, [4096] * 64, [4096] * 128]
    for contexts in long_cases:
        probe.set_decoders(len(contexts), contexts)
        step_s = probe.decode_step_s(20)
        moved = weight_bytes + kv_token_bytes * sum(contexts)
        decode_rows.append(
            {"rows": len(contexts), "kv_tokens": sum(contexts), "max_context": max(contexts), "step_s": step_s,
             "bytes_per_s": moved / step_s}
        )  # fmt: skip
        print(
            f"decode {len(contexts)} rows, {sum(contexts):,} KV tokens (max {max(contexts):,}): "
            f"{step_s * 1e3:.2f} ms, {moved / step_s / 1e12:.2f} TB/s",
            flush=True,
        )

    profiles = []
    if not (args.no_profile or args.only_decode) and torch.cuda.is_available():
        probe.set_decoders(decoder_counts[-1], context)
        for chunks, cached in ([[1024], 0], [[256] * 4, 0], [[1024], 16384]):
            p = profile_step(probe, chunks, cached, 25)
            print(f"profile {chunks} over {cached}: wall {p['wall_s'] * 1e3:.2f} ms, kernels {p['kernel_s'] * 1e3:.2f}")
            print(p["table"], flush=True)
            profiles.append(p)
    for rid in probe.decoders:
        engine.abort_request(rid)

    result = {
        "probe": "mixed_steps",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "backend": engine.attention.name,
        "decode_programs": args.decode_programs or None,
        "shape": args.shape,
        "rows": rows,
        "decode": decode_rows,
        "profiles": [{k: v for k, v in p.items() if k != "table"} for p in profiles],
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
