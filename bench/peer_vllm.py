"""vLLM's engine-level numbers for the side-by-side benchmark: the measures of bench/peer_plan.py (the same
ones bench/engine.py takes of kvserve, under the same JSON keys) through vLLM's offline API, vllm.LLM with
random weights in our benchmark shape, prefix caching on, and prompts of random token ids (TokensPrompt).

Runs on the GPU machine in vLLM's own site (../shared/tools/vllm-peer/README.md; bench/peer_h200.sh
vllm-engine), where our packages are absent: it imports only bench/peer_plan.py of ours. vLLM's start-up
(torch.compile and CUDA graph capture) takes ~200 s; the measures ~80 s more. The result file is rewritten
after every measure, so a run cut short keeps what it finished.

    PYTHONPATH=/tmp/vsite python3 bench/peer_vllm.py --out $OUT/vllm-engine.json
    PYTHONPATH=/tmp/vsite python3 bench/peer_vllm.py --shape dsv2-lite-chat --out $OUT/vllm-engine.json
    python bench/peer_vllm.py --quick --dry-run      # here: the plan and the LLM arguments, no vLLM
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peer_plan import SCHEMA, plan_for, run_plan, write_partial  # noqa: E402
from loadgen.provenance import provenance  # noqa: E402

SHAPES = ROOT / "bench" / "shapes"


def llm_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """vllm.LLM's keyword arguments: the settings `vllm serve` gets in bench/peer_h200.sh, offline."""
    kwargs: dict[str, Any] = {
        "model": str(SHAPES / args.shape),
        "load_format": "dummy",  # random weights, as bench/engine.py's load_format dummy
        "skip_tokenizer_init": True,  # prompts are token ids; no text in or out
        "enable_prefix_caching": True,
        "dtype": "bfloat16",
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
        "seed": 0,
    }
    if args.max_num_batched_tokens:  # else vLLM's own default for the offline API (16384 on an H200)
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kwargs


class VllmEngine:
    """bench/peer_plan.py's PeerEngine over vllm.LLM: LLM.generate is synchronous and returns when every
    request has finished, so its wall time is the batch's time (the engine core runs in its own process)."""

    def __init__(self, llm: Any) -> None:
        from vllm import SamplingParams, TokensPrompt

        self.llm = llm
        self._sampling = SamplingParams
        self._prompt = TokensPrompt
        self.last_outputs: list[list[int]] = []

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[int]]:
        params = self._sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        inputs = [self._prompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        outputs = self.llm.generate(inputs, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        for out in outputs:
            produced = len(out.outputs[0].token_ids)
            if produced != max_tokens:
                raise RuntimeError(f"vLLM produced {produced} tokens, asked for {max_tokens} (ignore_eos=True)")
        self.last_outputs = [list(out.outputs[0].token_ids) for out in outputs]
        return seconds, [int(out.num_cached_tokens or 0) for out in outputs]


def gpu_name() -> str:
    """From nvidia-smi: touching CUDA in this process before vLLM starts its engine would hold a context."""
    try:
        return subprocess.check_output(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], text=True).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def engine_setting(llm: Any, section: str, name: str) -> Any:
    """A setting vLLM resolved at start-up (its defaults depend on the GPU), None where 0.25 keeps it elsewhere."""
    try:
        return getattr(getattr(llm.llm_engine.vllm_config, section), name)
    except AttributeError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="", help="result JSON, rewritten after every measure")
    parser.add_argument("--quick", action="store_true", help="bench/peer_plan.py's tiny sizes")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and LLM arguments, start nothing")
    parser.add_argument("--shape", default="llama-8b-chat", help="a folder of bench/shapes (config + tokenizer)")
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=0, help="0: vLLM's default; give it ours (engine.py's 32768)"
    )
    parser.add_argument("--commit", default=os.environ.get("COMMIT", ""), help="kvserve commit of this checkout")
    parser.add_argument(
        "--only-measures", default="", help="comma-separated measure names of bench/peer_plan.py: just those"
    )
    args = parser.parse_args()
    if not (SHAPES / args.shape / "config.json").is_file():
        parser.error(f"no shape {args.shape!r} in {SHAPES}")
    plan = plan_for(args.quick)
    if args.only_measures:  # the same ids as in a whole run: each measure draws from a stream of its own
        wanted = set(args.only_measures.split(","))
        unknown = wanted - {m.name for m in plan.measures}
        if unknown:
            parser.error(f"--only-measures: no such measures {sorted(unknown)}")
        plan = dataclasses.replace(plan, measures=tuple(m for m in plan.measures if m.name in wanted))
    kwargs = llm_arguments(args)
    if plan.max_model_len > args.max_model_len:
        parser.error(f"the plan needs max_model_len >= {plan.max_model_len}")
    if args.dry_run:
        print(json.dumps({"llm": kwargs, "measures": [m.name for m in plan.measures]}, indent=2))
        return

    import vllm

    vocab_size = int(json.loads((SHAPES / args.shape / "config.json").read_text())["vocab_size"])
    t0 = time.perf_counter()
    llm = vllm.LLM(**kwargs)
    startup_s = time.perf_counter() - t0
    print(f"vLLM {vllm.__version__} up in {startup_s:.0f} s", flush=True)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "engine": f"vllm {vllm.__version__}",
        "date": dt.date.today().isoformat(),
        "commit": args.commit,
        "provenance": provenance(ROOT),
        "gpu": gpu_name(),
        "shape": args.shape,
        "dtype": "bfloat16",
        "quick": args.quick,
        "settings": {
            "llm": kwargs,
            "block_size": engine_setting(llm, "cache_config", "block_size"),
            "max_num_batched_tokens": engine_setting(llm, "scheduler_config", "max_num_batched_tokens"),
            "max_model_len": args.max_model_len,
            "startup_s": startup_s,
            "repeats": plan.repeats,
            "decode_timing": "(t(1 + steps output tokens) - t(1)) / steps over the same cached prompts",
            # how its MoE routes: None is the model's own router, which with dummy weights sends every token of
            # a batch to the same experts (bench/peer_h200.sh VLLM_ROUTING says why); a name is vLLM's routing
            # simulation (VLLM_MOE_ROUTING_SIMULATION_STRATEGY, e.g. uniform_random)
            "moe_routing_simulation": os.environ.get("VLLM_MOE_ROUTING_SIMULATION_STRATEGY") or None,
        },
        "measures": {},
    }
    write_partial(args.out, result)

    def done(name: str, entry: dict[str, Any]) -> None:
        result["measures"][name] = entry
        print(f"{name}: {entry['seconds']:.4f} s {entry.get('cached_tokens', '')}", flush=True)
        write_partial(args.out, result)

    run_plan(plan, VllmEngine(llm), vocab_size, done)
    print(f"done: {len(result['measures'])} measures" + (f", wrote {args.out}" if args.out else ""), flush=True)


if __name__ == "__main__":  # vLLM starts its engine core in a spawned process, which imports this module again
    main()
