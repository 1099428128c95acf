"""Engine benchmark: prefill throughput and MFU, decode throughput and bandwidth share, TTFT cold vs warm,
and the greedy token match rate of warm (prefix-cached) against cold runs.

Random weights in a real shape (bench/shapes/<name>/config.json), driven through the same engine the rank
worker serves with (build_engine), timed after torch.cuda.synchronize. Prints a table, writes JSON.
`measures` holds the side-by-side set of bench/peer_plan.py under the keys bench/peer_vllm.py writes for vLLM;
`prefill`, `decode` and `ttft` are the rows the simulator's step-time fit reads (simulator/step_time.py).

    RUN=bench/results/$(date -u +%F)-h200-engine                                 # a run folder: bench/results/README.md
    python bench/engine.py --shape llama-8b --out $RUN/engine.json                # on the H200
    python bench/engine.py --shape llama-8b --dtype float32 --only-match --merge-into $RUN/engine.json
    python bench/engine.py --shape tiny --quick                                   # smoke run on a CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer_plan import SCHEMA, Measure, plan_for, run_plan, write_partial  # noqa: E402
from contracts.config import load_config  # noqa: E402
from loadgen.provenance import checkout_record  # noqa: E402
from rank_worker.engine.factory import build_engine  # noqa: E402
from rank_worker.engine.interface import EngineRequest, SamplingParams  # noqa: E402
from rank_worker.engine.paged_engine import PagedEngine  # noqa: E402
from simulator import model_cost  # noqa: E402

PEAK_BF16_FLOPS = 783e12  # measured on the H200 (../shared/design/performance.md)
PEAK_HBM_BYTES_PER_S = 4.2e12


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Bench:
    def __init__(self, engine: PagedEngine, config: dict, seed: int = 0) -> None:
        self.engine = engine
        self.config = config  # the shape's config.json: what a token costs (bench/model_cost.py)
        self.cfg = engine.model.cfg
        self.gen = torch.Generator().manual_seed(seed)
        self.counter = 0
        self.decode_rows: list[dict] = []
        self.last_outputs: list[list[int]] = []  # run()'s, per prompt (bench/peer_plan.py's PeerEngine)

    def prompt(self, length: int) -> list[int]:
        return torch.randint(0, self.cfg.vocab_size, (length,), generator=self.gen).tolist()

    def request(self, prompt: list[int], max_tokens: int) -> str:
        self.counter += 1
        rid = f"b{self.counter}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(EngineRequest(rid, prompt, params))
        return rid

    def drain(self) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens

    def time_first_token(self, prompt: list[int], max_tokens: int = 1) -> tuple[float, list[int], int]:
        """Seconds from submission to the first token (the whole prefill), the tokens, cached tokens."""
        sync()
        start = time.perf_counter()
        rid = self.request(prompt, max_tokens)
        first = None
        tokens: list[int] = []
        cached = 0
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id != rid:
                    continue
                if first is None and (out.new_token_ids or out.finished):
                    sync()
                    first = time.perf_counter() - start
                tokens.extend(out.new_token_ids)
                if out.finished and out.stats:
                    cached = out.stats.l0_cached_tokens
        assert first is not None
        return first, tokens, cached

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        """Seconds from submitting every prompt together until the last finished, and each one's cached tokens
        (bench/peer_plan.py's PeerEngine)."""
        sync()
        start = time.perf_counter()
        ids = [self.request(prompt, max_tokens) for prompt in prompts]
        cached: dict[str, int] = {}
        tokens: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished and out.stats:
                    cached[out.request_id] = out.stats.l0_cached_tokens
        sync()
        seconds = time.perf_counter() - start
        self.last_outputs = [tokens[rid] for rid in ids]
        return seconds, [cached.get(rid, 0) for rid in ids]

    # --- the measurements ---

    def prefill_flops(self, new: int, cached: int = 0) -> float:
        return model_cost.prefill_flops(self.config, new, cached)

    def prefill(self, lengths: list[int], repeats: int) -> list[dict]:
        rows = []
        self.time_first_token(self.prompt(min(lengths)))  # warm-up: kernels, allocator
        for n in lengths:
            times = [self.time_first_token(self.prompt(n))[0] for _ in range(repeats)]
            t = statistics.median(times)
            rows.append(
                {"tokens": n, "seconds": t, "tokens_per_s": n / t, "mfu": self.prefill_flops(n) / t / PEAK_BF16_FLOPS}
            )
        return rows

    def decode_direct(self, m: Measure, prompts: list[list[int]]) -> None:
        """Step time of a batch of these prompts (cached: their prefill is short), timed over decode-only steps
        with no request starting or finishing in them: the legacy decode row (self.decode_rows)."""
        steps = m.steps
        batch, context = len(prompts), len(prompts[0])
        element = self.engine.kv_cache.element_size()
        weight_bytes = model_cost.decode_weight_params(self.config, batch) * element  # the experts the rows pick
        kv_bytes_per_token = model_cost.kv_bytes_per_token(self.config, element)
        ids = [self.request(prompt, max_tokens=steps + 12) for prompt in prompts]
        produced = dict.fromkeys(ids, 0)
        while min(produced.values()) < 2:  # every sequence past its prefill and into decode
            for out in self.engine.step():
                produced[out.request_id] += len(out.new_token_ids)
        for _ in range(3):  # warm-up at this batch shape
            self.engine.step()
        sync()
        start = time.perf_counter()
        for _ in range(steps):
            self.engine.step()
        sync()
        step_s = (time.perf_counter() - start) / steps
        self.drain()
        ctx = context + 6 + steps // 2  # average context during the timed steps is a little above the prompt
        moved = weight_bytes + batch * ctx * kv_bytes_per_token
        self.decode_rows.append(
            {
                "batch": batch,
                "context": context,
                "step_ms": step_s * 1e3,
                "tokens_per_s": batch / step_s,
                "bw_share": moved / step_s / PEAK_HBM_BYTES_PER_S,
            }
        )

    @staticmethod
    def ttft_rows(entries: dict[str, dict]) -> list[dict]:
        """The legacy TTFT rows (cold vs warm per context) from the ttft_{cold,warm}_* measures."""
        rows = []
        for name, warm in entries.items():
            cold = entries.get(name.replace("ttft_warm_", "ttft_cold_"))
            if not name.startswith("ttft_warm_") or cold is None:
                continue
            rows.append(
                {
                    "context": warm["cached"],
                    "new_tokens": warm["new"],
                    "cold_s": cold["seconds"],
                    "warm_s": warm["seconds"],
                    "speedup": cold["seconds"] / warm["seconds"],
                    "warm_cached_tokens": warm["cached_tokens"],
                    "cold_cached_tokens": cold["cached_tokens"],
                }
            )
        return rows

    def warm_cold_match(self, prompts: int, context: int, new_tokens: int, tokens: int) -> dict:
        """Greedy tokens of a warm run (history cached) vs a cold one (cache cleared) on the same prompt.

        bf16 rounding differs between the two paths (one causal pass vs a chunk over cached K/V); random
        weights give nearly flat logits, so tiny differences flip the argmax. The first token's logits are
        compared too: a relative error at bf16 level means rounding, an O(1) error would mean a bug."""
        equal = total = identical = 0
        errors: list[float] = []
        for _ in range(prompts):
            history = self.prompt(context)
            full = history + self.prompt(new_tokens)
            self.engine.pool.clear_cache()
            with LogitTap(self.engine) as cold_tap:
                _, cold, cached_cold = self.time_first_token(full, tokens)
            assert cached_cold == 0
            self.engine.pool.clear_cache()
            self.time_first_token(history)
            with LogitTap(self.engine) as warm_tap:
                _, warm, cached_warm = self.time_first_token(full, tokens)
            assert cached_warm > 0
            assert cold_tap.first is not None and warm_tap.first is not None
            errors.append(float((warm_tap.first - cold_tap.first).norm() / cold_tap.first.norm()))
            equal += sum(a == b for a, b in zip(cold, warm, strict=True))
            total += len(cold)
            identical += cold == warm
        return {
            "prompts": prompts,
            "context": context,
            "tokens": tokens,
            "position_match": equal / total,
            "identical_sequences": identical / prompts,
            "first_logits_rel_err_max": max(errors),
        }


class LogitTap:
    """Keeps the logits of the first forward that samples (bench instrumentation only)."""

    def __init__(self, engine: PagedEngine) -> None:
        self.model = engine.model
        self.first: torch.Tensor | None = None

    def __enter__(self) -> LogitTap:
        original = self.model.forward

        def tapped(*args, **kwargs):
            logits = original(*args, **kwargs)
            if self.first is None and logits.shape[0] > 0:
                self.first = logits[0].float().clone()
            return logits

        self.model.forward = tapped  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.model.forward  # back to the class method


def prefill_attention(attention) -> str:
    """What ran a prefill chunk's attention: the MLA backend's prefill goes through flash-attn 4 where it is
    installed and compiled at start-up, else through SDPA (about 3x slower on a chunk over a long cached prefix:
    bench/results/2026-12-05-h100-peer-dsv2-engine); the other backends prefill with their own kernel."""
    fa4 = getattr(attention, "fa4_prefill", None)
    if fa4 is None:
        return attention.name
    return "fa4" if fa4 else "sdpa"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-8b")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run of the script itself")
    parser.add_argument("--out", default="", help="result JSON, rewritten after every measure")
    parser.add_argument("--commit", default="", help="commit to record (defaults to git HEAD)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=32768)
    parser.add_argument(
        "--solo-prefill-tokens",
        type=int,
        default=None,
        help="a cold prompt alone on the rank in one step up to this (default: the attention backend's choice)",
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--attention-backend", default="auto", choices=["auto", "triton", "fa4", "flashinfer", "sdpa"])
    parser.add_argument(
        "--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3"], help="fp8_e4m3: twice the tokens a pool"
    )
    parser.add_argument(
        "--only-measures",
        default="",
        help="comma-separated measure names of bench/peer_plan.py: just those (no match, no legacy prefill rows)",
    )
    parser.add_argument(
        "--random-weights",
        default="normal",
        choices=["normal", "uniform"],
        help="uniform: vLLM's dummy draw (uniform(-1e-3, 1e-3) everywhere), for a MoE's routing like vLLM's",
    )
    parser.add_argument("--only-match", action="store_true", help="just the warm-vs-cold match (e.g. in float32)")
    parser.add_argument(
        "--merge-into",
        default="",
        help="with --only-match: record the match in this result file as warm_cold_match_<dtype>",
    )
    args = parser.parse_args()
    if args.merge_into and not args.only_match:
        parser.error("--merge-into goes with --only-match")

    plan = plan_for(args.quick)
    if args.only_measures:
        wanted = set(args.only_measures.split(","))
        unknown = wanted - {m.name for m in plan.measures}
        if unknown:
            parser.error(f"--only-measures: no such measures {sorted(unknown)}")
        plan = dataclasses.replace(plan, measures=tuple(m for m in plan.measures if m.name in wanted))
    match_plan = (2, 256, 32, 8) if args.quick else (8, 4096, 256, 64)
    legacy_prefill = [128, 256] if args.quick else [2048, 8192, 32768]
    config = load_config(
        model=str(ROOT / "bench" / "shapes" / args.shape / "config.json"),
        load_format="dummy",
        random_weights=args.random_weights,
        dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        solo_prefill_tokens=args.solo_prefill_tokens,
        max_num_seqs=256,
        attention_backend=args.attention_backend,
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=max(plan.max_model_len, match_plan[1] + match_plan[2] + match_plan[3] + 64),
    )
    t0 = time.perf_counter()
    engine = build_engine(config)
    startup_s = time.perf_counter() - t0
    shape_config = json.loads((ROOT / "bench" / "shapes" / args.shape / "config.json").read_text())
    bench = Bench(engine, shape_config)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"
    dtype = str(engine.model.embed_tokens.dtype).removeprefix("torch.")  # the model's (the pool's may be fp8)
    print(
        f"engine up in {startup_s:.1f}s on {gpu}: {engine.pool.num_blocks} blocks of {config.engine.block_size}",
        flush=True,
    )

    if args.only_match:
        match = bench.warm_cold_match(*match_plan)
        print("match", match, flush=True)
        if args.merge_into:
            merge_match(Path(args.merge_into), dtype, match)
        return

    result = {
        "schema": SCHEMA,
        "engine": "kvserve",
        "date": dt.date.today().isoformat(),
        **checkout_record(args.commit),
        "gpu": gpu,
        "torch": torch.__version__,
        "shape": args.shape,
        "dtype": dtype,
        "quick": args.quick,
        "settings": {
            "block_size": engine.settings.engine.block_size,
            "attention_backend": engine.attention.name,
            "prefill_attention": prefill_attention(engine.attention),
            "kv_cache_dtype": str(engine.kv_cache.dtype).removeprefix("torch."),
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "solo_prefill_tokens": engine.scheduler.policy.solo_prefill_tokens,
            "max_model_len": config.max_model_len,
            "kv_blocks": engine.pool.num_blocks,
            "random_weights": args.random_weights,
            "startup_s": startup_s,
            "repeats": plan.repeats,
            "decode_timing": "(t(1 + steps output tokens) - t(1)) / steps over the same cached prompts",
        },
        "measures": {},
        "model_cost": cost_summary(shape_config, engine),
    }

    def done(name: str, entry: dict) -> None:
        if engine.step_cap.dropped_steps:  # it timed the shorter steps the engine went on with (step_token_cap.py)
            raise SystemExit(f"{name}: a step ran out of GPU memory and was dropped; not recorded")
        result["measures"][name] = entry
        print(f"{name}: {entry['seconds']:.4f} s {entry.get('cached_tokens', '')}", flush=True)
        write_partial(args.out, result)

    measures = run_plan(plan, bench, bench.cfg.vocab_size, done, after_decode=bench.decode_direct)
    result["decode"] = bench.decode_rows
    result["ttft"] = bench.ttft_rows(measures)
    write_partial(args.out, result)
    if args.only_measures:
        print_tables(result)
        return
    match = bench.warm_cold_match(*match_plan)
    print("match", match, flush=True)
    result["warm_cold_match"] = match["position_match"]
    result["warm_cold_match_detail"] = match
    write_partial(args.out, result)
    result["prefill"] = bench.prefill(legacy_prefill, plan.repeats)
    print("prefill", result["prefill"], flush=True)
    write_partial(args.out, result)
    print_tables(result)
    if args.out:
        print(f"wrote {args.out}")


def cost_summary(config: dict, engine: PagedEngine) -> dict:
    """The shape's per-token costs (bench/model_cost.py) and how many 100K-token sessions this pool holds."""
    element = engine.kv_cache.element_size()
    pool_bytes = engine.kv_cache.numel() * element
    return {
        "matmul_params_active": model_cost.matmul_params(config),
        "params_total": model_cost.total_params(config),
        "kv_bytes_per_token": model_cost.kv_bytes_per_token(config, element),
        "kv_pool_bytes": pool_bytes,
        "sessions_100k_in_pool": model_cost.sessions_fitting(config, pool_bytes, 100_000, element),
    }


def merge_match(path: Path, dtype: str, match: dict) -> None:
    """Record a match run of another dtype in an existing result file (the float32 run needs its own engine)."""
    result = json.loads(path.read_text())
    result[f"warm_cold_match_{dtype}"] = match["position_match"]
    result[f"warm_cold_match_{dtype}_detail"] = match
    write_partial(path, result)
    print(f"recorded warm_cold_match_{dtype} in {path}")


def print_tables(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    t = Table(title=f"prefill ({result['shape']}, {result['gpu']})")
    for col in ("tokens", "tokens/s", "MFU"):
        t.add_column(col, justify="right")
    for r in result.get("prefill", []):
        t.add_row(f"{r['tokens']:,}", f"{r['tokens_per_s']:,.0f}", f"{r['mfu']:.0%}")
    console.print(t)
    t = Table(title="decode")
    for col in ("batch", "context", "ms/step", "tokens/s", "bandwidth share"):
        t.add_column(col, justify="right")
    for r in result["decode"]:
        t.add_row(
            str(r["batch"]),
            f"{r['context']:,}",
            f"{r['step_ms']:.1f}",
            f"{r['tokens_per_s']:,.0f}",
            f"{r['bw_share']:.0%}",
        )
    console.print(t)
    t = Table(title="TTFT, cold vs warm (prefix cached)")
    for col in ("context", "new tokens", "cold s", "warm s", "speedup"):
        t.add_column(col, justify="right")
    for r in result["ttft"]:
        t.add_row(
            f"{r['context']:,}",
            f"{r['new_tokens']:,}",
            f"{r['cold_s']:.3f}",
            f"{r['warm_s']:.3f}",
            f"{r['speedup']:.1f}x",
        )
    console.print(t)
    t = Table(title="side-by-side measures (bench/peer_plan.py)")
    for col in ("measure", "new", "cached", "batch", "seconds", "cached seen"):
        t.add_column(col, justify="right")
    for name, e in result["measures"].items():
        t.add_row(
            name,
            f"{e['new']:,}",
            f"{e['cached']:,}",
            str(e["batch"] or ""),
            f"{e['seconds']:.4f}",
            f"{e.get('cached_tokens', ''):,}" if "cached_tokens" in e else "",
        )
    console.print(t)
    detail = result.get("warm_cold_match_detail")
    if detail is None:
        return  # an --only-measures run
    console.print(
        f"greedy warm-vs-cold token match: {result['warm_cold_match']:.1%} of positions "
        f"({detail['prompts']} prompts x {detail['tokens']} tokens); first-token logits rel. error "
        f"<= {detail['first_logits_rel_err_max']:.1e}"
    )


if __name__ == "__main__":
    main()
