"""`kvserve bench simulate`: predict the load generator's steps for a node of R ranks, without a GPU.

The workload replays through the real scheduler, KV cache manager, block pool (rank_worker/engine) and
routing (router/) with step times fitted to the engine benchmark's GPU measurements; see
simulator/README.md for what is modelled and what is not.

    kvserve bench simulate --shape llama-8b --ranks 1 --agents 4,8,16,32 --monthly-price 20000 --json sim.json
    kvserve bench simulate --synthetic 128k --ranks 8 --agents 16,32,64,128 --scheduling fifo
    kvserve bench simulate --config bench/configs/agents-h200.yaml --calibrate agents.json --json calibrate.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from rich.console import Console
from rich.table import Table

from contracts.config import DEFAULTS, EngineConfig, SchedulingConfig, load_config
from loadgen.agent import ThinkTime
from loadgen.provenance import checkout_record
from loadgen.report import TABLE_COLUMNS, add_pass_bar_arguments, step_row, thresholds_from
from loadgen.workload import SYNTHETIC_TARGETS, fitting_factor, load_workload, turns_replayed
from router.route_score import RoutePolicy
from simulator.calibration import COMPARED, compare_steps, load_measured
from simulator.capacity import capacity_summary, simulate_steps
from simulator.kv_capacity import kv_pool_blocks, shape_facts
from simulator.nodes import node_choice_results, node_choices, run_node_choices
from simulator.replay import NodeSettings, WorkloadSettings
from simulator.sim_rank import RankSettings
from simulator.step_time import fit_report, fit_step_time, load_engine_results

# The GPU measurements the step-time model and the L1 restore cost are fitted to (engine-, decode- and l1-<gpu>.json).
CALIBRATION_DIR = Path(__file__).resolve().parent / "results"
# The engine benchmark the simulator is calibrated on: the engine the decode probe measured too. Later engines are
# faster; the simulator moves to one once a decode probe of it exists (both fits must describe one engine).
CALIBRATION_ENGINE_RESULTS = CALIBRATION_DIR / "engine-h200.json"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve bench simulate", description=__doc__.split("\n\n")[0])
    node = parser.add_argument_group("node (unset flags come from --config, else the config's defaults)")
    node.add_argument("--config", default=None, help="the served stack's YAML config (engine, L1, router keys)")
    node.add_argument("--shape", default=None, help="bench/shapes/<name> or a config.json (default: llama-8b)")
    node.add_argument(
        "--engine-results",
        default=str(CALIBRATION_ENGINE_RESULTS),
        help="bench/engine.py JSON the step times are fitted to (with the decode probe of the same engine)",
    )
    node.add_argument(
        "--decode-results",
        default=None,
        help="simulator/decode_probe.py JSON (default: simulator/results/decode-<gpu>.json if there; 'none': off)",
    )
    node.add_argument("--ranks", type=int, default=1, help="ranks (GPUs) of the node")
    node.add_argument("--nodes", type=int, default=1, help="nodes behind the gateway's EPP, each of --ranks ranks")
    node.add_argument(
        "--node-choice",
        default=None,
        help="the EPP's node choice, comma-separated to compare: prefix, round_robin, least_loaded (default prefix)",
    )
    node.add_argument("--kv-blocks", type=int, default=None, help="KV pool per rank (default: measured, or HBM)")
    node.add_argument("--hbm-gb", type=float, default=None, help="GPU memory (10^9 B) to size the pool from")
    node.add_argument("--gpu-memory-utilization", type=float, default=None)
    node.add_argument("--activation-gb", type=float, default=9.0, help="activation peak the pool leaves room for")
    node.add_argument("--block-size", type=int, default=None)
    node.add_argument("--max-num-seqs", type=int, default=None)
    node.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="default: --config's, else the engine benchmark's"
    )
    node.add_argument(
        "--l1-gb", type=float, default=None, help="node host cache (L1) in GB (default: --config's, else 0)"
    )
    node.add_argument("--l1-gbps", type=float, default=None, help="restore bandwidth (default: simulator/results/l1-*)")
    node.add_argument("--l1-restore-cost", type=float, default=None, help="router score")
    node.add_argument(
        "--l1-eviction-horizon-blocks",
        type=int,
        default=None,
        help="L0 entries next in line for eviction offered to L1 again (default: --config's; 0: write-through only)",
    )
    node.add_argument(
        "--l1-paced-copies",
        action="store_true",
        help="pace write-through copies as the real tier (l1_offload_mb_per_step a step, their blocks pinned in "
        "the pool until they land); default: each lands at once, pinning nothing",
    )
    node.add_argument(
        "--l1-copy-latency",
        type=float,
        default=0.0,
        help="with --l1-paced-copies: seconds from a copy's issue to its landing (default: by the next step)",
    )
    node.add_argument(
        "--l1-exclusive-ideal",
        action="store_true",
        help="an upper bound for exclusive tiers: no write-through, and every block L0 evicts is in L1 before it "
        "is reused (no copy time, no pace); what the tiers could hold if their capacities added up",
    )
    node.add_argument(
        "--l1-exclusive-copy-gbps",
        type=float,
        default=None,
        help="with --l1-exclusive-ideal: charge each step the copies of the blocks its allocations evicted at this "
        "many GB/s, none overlapping the step before (a bound from below)",
    )
    node.add_argument("--overload-prefill-tokens", type=int, default=None)

    policy = parser.add_argument_group("scheduling")
    policy.add_argument("--scheduling", dest="scheduling_policy", choices=("warm_first", "fifo"), default=None)
    policy.add_argument("--ab", action="store_true", help="run both policies (fifo and warm_first) side by side")
    policy.add_argument("--warm-prefix-fraction", type=float, default=None)
    policy.add_argument("--max-cold-prefills", type=int, default=None)
    policy.add_argument("--cold-max-wait", dest="cold_max_wait_secs", type=float, default=None, help="seconds")
    policy.add_argument("--decode-step-budget-ms", type=float, default=None, help="a step with decoders; 0 = off")
    policy.add_argument(
        "--min-prefill-chunk",
        dest="min_prefill_chunk_tokens",
        type=int,
        default=None,
        help="prefill tokens a step always gets",
    )
    policy.add_argument(
        "--decode-payback",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="steps past the decode budget paid back by decode-only steps (default: --config's decode_payback)",
    )

    work = parser.add_argument_group("workload (as kvserve bench agents; --calibrate fills what is not given)")
    work.add_argument("--trace", choices=("claude_code", "mooncake"), default=None, help="default claude_code")
    work.add_argument("--trace-path", default=None, help="a trace dir or file (default under /work/shared/traces)")
    work.add_argument("--synthetic", choices=tuple(SYNTHETIC_TARGETS), default=None, help="synthetic target context")
    work.add_argument("--synthetic-turns", type=int, default=10, help="turns per synthetic agent")
    work.add_argument("--agents", default=None, help="comma-separated agent counts (default 4,8,16,32)")
    work.add_argument("--duration", type=float, default=None, help="seconds per step (default 300 without --turns)")
    work.add_argument("--turns", type=int, default=None, help="calls per agent per step")
    work.add_argument("--stagger", type=float, default=0.0, help="spread agent starts over this many seconds")
    work.add_argument("--think-time", default=None, help="seconds between an agent's calls, or 'trace' (default 3)")
    work.add_argument("--max-think", type=float, default=120.0, help="cap on trace think times (s)")
    work.add_argument("--context-scale", type=float, default=None, help="input size factor (default: fit context)")
    work.add_argument("--max-context", type=int, default=None, help="served context (default: the shape's)")
    work.add_argument("--max-output-tokens", type=int, default=None, help="cap on the trace's output lengths")
    work.add_argument("--seed", type=int, default=None, help="id namespace and synthetic draws (default 0)")

    add_pass_bar_arguments(parser)

    out = parser.add_argument_group("output")
    out.add_argument("--monthly-price", type=float, default=None, help="the node's price per month (any currency)")
    out.add_argument("--calibrate", default=None, help="a measured agents JSON to compare with (e.g. agents-h200)")
    out.add_argument("--json", default=None, help="write the results here")
    out.add_argument(
        "--calls",
        action="store_true",
        help="with --json: every call's record (and its L1 tokens) in each step, for bench/sim_vs_gpu.py",
    )
    return parser


def _fill_from_measured(args: argparse.Namespace, measured: dict[str, Any]) -> None:
    """Replay what the measured run replayed: its agent counts, workload and pass bar, unless given here."""
    workload = measured.get("workload") or {}
    if args.agents is None:
        args.agents = ",".join(str(step["agents"]) for step in measured["steps"])
    if args.trace is None and args.synthetic is None:
        args.synthetic = workload.get("synthetic")
        args.trace = workload.get("trace") or "claude_code"
    if args.trace_path is None:
        args.trace_path = workload.get("trace_path")
    for name, key in (
        ("context_scale", "context_scale"),
        ("think_time", "think_time"),
        ("seed", "seed"),
        ("max_context", "max_context"),
        ("max_output_tokens", "max_output_tokens"),
    ):
        if getattr(args, name) is None and measured.get(key) is not None:
            setattr(args, name, measured[key])
    if args.duration is None and args.turns is None:
        args.duration = measured.get("duration_s")
        args.turns = measured.get("turns")


def _given(args: argparse.Namespace, section: type[BaseModel]) -> dict[str, Any]:
    """The flags given here that are keys of a config section (a flag's dest is its key there)."""
    return {key: getattr(args, key) for key in section.model_fields if getattr(args, key, None) is not None}


def _fill_from_config(args: argparse.Namespace) -> tuple[EngineConfig, SchedulingConfig]:
    """Node settings from --config (a served stack's YAML) or the config's defaults, unless given here; returns
    the config's engine and scheduling sections with the flags given here over them. Without --config the chunk
    (max_num_batched_tokens) is the engine benchmark's unless given (main)."""
    config = load_config(args.config) if args.config else DEFAULTS
    if args.overload_prefill_tokens is None:
        args.overload_prefill_tokens = config.overload_prefill_tokens
    engine = config.engine.model_copy(update=_given(args, EngineConfig))
    scheduling = config.scheduling.model_copy(update=_given(args, SchedulingConfig))
    # The simulated rank is a GPU's, whose budget an unset one is; solo prefills are not simulated.
    scheduling = scheduling.model_copy(
        update={"decode_step_budget_ms": scheduling.step_budget_ms(cuda=True), "solo_prefill_tokens": 0}
    )
    if args.config is None:
        args.shape = args.shape or "llama-8b"
        args.l1_gb = 0.0 if args.l1_gb is None else args.l1_gb
        return engine, scheduling
    if args.shape is None:
        args.shape = config.model if config.model.endswith("config.json") else "llama-8b"
    if args.max_context is None and config.max_model_len:
        args.max_context = config.max_model_len
    if args.l1_gb is None:
        args.l1_gb = config.l1_host_gb if config.l1_cache and config.engine.prefix_cache else 0.0
    return engine, scheduling


def _think(text: str, cap_s: float) -> ThinkTime:
    if str(text) == "trace":
        return ThinkTime(fixed=None, cap_s=cap_s)
    seconds = float(text)
    if seconds < 0:
        raise ValueError("--think-time must not be negative")
    return ThinkTime(fixed=seconds, cap_s=cap_s)


def _agent_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise ValueError("--agents needs positive counts, e.g. 4,8,16")
    return counts


def _l1_gbps(args: argparse.Namespace, gpu_tag: str) -> float:
    if args.l1_gbps is not None:
        return args.l1_gbps
    path = CALIBRATION_DIR / f"l1-{gpu_tag}.json"
    if path.is_file():
        rows = json.loads(path.read_text()).get("restore", [])
        if rows:
            return float(max(rows, key=lambda r: r["bytes"])["GBps"])
    return 50.0  # the H200's scattered restore bandwidth (results/l1-h200.json)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    try:
        measured = load_measured(args.calibrate) if args.calibrate else None
        if measured is not None:
            _fill_from_measured(args, measured)
        engine, scheduling = _fill_from_config(args)
        agent_counts = _agent_counts(args.agents or "4,8,16,32")
        think = _think(args.think_time if args.think_time is not None else "3", args.max_think)
        if args.ranks < 1:
            raise ValueError("--ranks must be at least 1")
        choices = node_choices(args.node_choice, args.nodes)
        facts = shape_facts(args.shape)
        engine_results = load_engine_results(args.engine_results)
        gpu_tag = Path(args.engine_results).stem.removeprefix("engine-")
        probe_path = args.decode_results or str(CALIBRATION_DIR / f"decode-{gpu_tag}.json")
        # The default file is used when there is one; a named one must be there.
        named = args.decode_results not in (None, "none")
        probe = load_engine_results(probe_path) if named or Path(probe_path).is_file() else None
        sessions = load_workload(
            args.trace or "claude_code",
            args.trace_path,
            args.synthetic,
            max(agent_counts),
            args.synthetic_turns,
            args.seed or 0,
        )
    except (OSError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2

    step_time = fit_step_time(engine_results, probe)
    if args.config is None and args.max_num_batched_tokens is None:
        engine = engine.model_copy(update={"max_num_batched_tokens": step_time.max_num_batched_tokens})
    settings = engine_results.get("settings", {})
    measured_pool = settings.get("kv_blocks") if engine_results.get("shape") == facts.name else None
    if args.kv_blocks is not None:
        kv_blocks = args.kv_blocks
    elif args.hbm_gb is None and measured_pool and settings.get("block_size", 16) == engine.block_size:
        kv_blocks = int(measured_pool)
    else:
        kv_blocks = kv_pool_blocks(
            facts, args.hbm_gb or 150.0, engine.gpu_memory_utilization, args.activation_gb, engine.block_size
        )
    duration = args.duration if args.duration is not None or args.turns is not None else 300.0
    max_context = args.max_context or facts.max_context
    turns = turns_replayed(sessions, max(agent_counts), args.turns)
    factor = args.context_scale or fitting_factor(turns, max_context, 0, args.max_output_tokens)
    rank = RankSettings(
        num_blocks=kv_blocks,
        max_model_len=max_context,
        engine=engine,
        kv_bytes_per_token=facts.kv_bytes_per_token,
        l1_bytes_per_s=_l1_gbps(args, gpu_tag) * 1e9,
        l1_paced_copies=args.l1_paced_copies,
        l1_copy_latency_s=args.l1_copy_latency,
        l1_exclusive_ideal=args.l1_exclusive_ideal,
        l1_exclusive_copy_bytes_per_s=args.l1_exclusive_copy_gbps * 1e9 if args.l1_exclusive_copy_gbps else None,
    )
    l1_blocks = int(args.l1_gb * 1e9 // rank.block_bytes)
    route = RoutePolicy(
        l1_restore_cost=scheduling.l1_restore_cost,
        overload_prefill_tokens=args.overload_prefill_tokens,
        warm_prefix_fraction=scheduling.warm_prefix_fraction,
    )
    workload = WorkloadSettings(
        agents=agent_counts[0],
        turns=args.turns,
        duration_s=duration,
        stagger_s=args.stagger,
        think=think,
        context_scale=factor,
        max_context=max_context,
        max_output_tokens=args.max_output_tokens,
        seed=args.seed or 0,
    )
    thresholds = thresholds_from(args)
    err.print(
        f"{len(sessions)} sessions, {args.shape} x {args.ranks} ranks of {kv_blocks} blocks "
        f"({kv_blocks * engine.block_size:,} tokens each), L1 {l1_blocks} blocks, context scale {factor:.4g}, "
        f"max context {max_context}"
    )
    policies = ("fifo", "warm_first") if args.ab else (scheduling.scheduling_policy,)
    runs: dict[str, list[dict[str, Any]]] = {}
    by_choice: dict[str, dict[str, list[dict[str, Any]]]] = {}
    started = time.monotonic()
    for name in policies:
        policy = scheduling.model_copy(update={"scheduling_policy": name})
        node = NodeSettings(args.ranks, dataclasses.replace(rank, policy=policy), l1_blocks, route)
        if args.nodes > 1:  # simulator/nodes.py: every node choice, each printed with per-node columns
            by_choice[name] = run_node_choices(
                sessions, agent_counts, workload, node, step_time, args.nodes, choices, thresholds,
                f"predicted steps ({name})", _print_table,
            )  # fmt: skip
            runs[name] = by_choice[name][choices[0]]
            continue
        runs[name] = simulate_steps(sessions, agent_counts, workload, node, step_time, thresholds, calls=args.calls)
        _print_table(f"predicted steps ({name})", runs[name])
    headline = scheduling.scheduling_policy if scheduling.scheduling_policy in runs else policies[-1]
    steps = runs[headline]
    summary = capacity_summary(steps, args.monthly_price)
    _print_summary(summary, args.ranks * args.nodes)

    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **checkout_record(),
        "simulated": True,
        "shape": facts.name,
        "engine_results": args.engine_results,
        "decode_results": probe_path if probe is not None else None,
        "ranks": args.ranks,
        "config": args.config,
        "kv_blocks_per_rank": kv_blocks,
        "l1_blocks": l1_blocks,
        "policy": scheduling.scheduling_policy,
        "scheduling": scheduling.model_dump(exclude={"scheduling_policy", "l1_restore_cost"}),  # those: policy, route
        "rank": rank.to_json(),
        "route": dataclasses.asdict(route),
        "heartbeat_interval_s": NodeSettings.heartbeat_interval_s,
        "workload": {
            "trace": None if args.synthetic else (args.trace or "claude_code"),
            "trace_path": args.trace_path,
            "synthetic": args.synthetic,
            "sessions": len(sessions),
        },
        "context_scale": factor,
        "think_time": args.think_time or "3",
        "duration_s": duration,
        "turns": args.turns,
        "max_output_tokens": args.max_output_tokens,
        "seed": args.seed or 0,
        "thresholds": dataclasses.asdict(thresholds),
        "step_time_model": step_time.to_json(),
        "step_time_fit": fit_report(step_time, engine_results, probe),
        "steps": steps,
        **summary,
        "sim_seconds": round(time.monotonic() - started, 1),
    }
    if args.ab:
        results["ab"] = runs
    if args.nodes > 1:  # per node-choice policy: its steps (with per-node statistics) and largest passing N
        results["nodes"] = args.nodes
        results["node_choice"] = node_choice_results(by_choice[headline], args.monthly_price)
    if measured is not None:
        results["calibration"] = {"measured": args.calibrate, "steps": compare_steps(steps, measured["steps"])}
        _print_calibration(results["calibration"]["steps"])
    if args.json:
        out = Path(args.json)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1) + "\n")
        err.print(f"wrote {out}")
    return 0


def _console() -> Console:
    return Console(width=None if sys.stdout.isatty() else 160)  # a log file gets the whole table


def _print_table(title: str, steps: list[dict[str, Any]]) -> None:
    table = Table(title=title)
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="right" if column != "verdict" else "left")
    for stats in steps:
        table.add_row(*step_row(stats))
    _console().print(table)


def _print_summary(summary: dict[str, Any], ranks: int) -> None:
    best = summary["largest_passing"]
    line = f"largest passing N on {ranks} rank(s): {best if best is not None else 'none'}"
    if summary.get("input_tokens_per_s"):
        line += f", {summary['input_tokens_per_s']:,.0f} input tokens/s"
    if summary.get("cost_per_million_input_tokens") is not None:
        line += f", {summary['cost_per_million_input_tokens']:.4f} per million input tokens"
    _console().print(line)


def _print_calibration(rows: list[dict[str, Any]]) -> None:
    table = Table(title="predicted / measured")
    table.add_column("agents", justify="right")
    names = [name for name in COMPARED if name != "passed"]
    for name in names:
        table.add_column(name, justify="right")
    for row in rows:
        cells = [str(row["agents"])]
        for name in names:
            ratio = row.get(name, {}).get("ratio")
            cells.append("-" if ratio is None else f"{ratio:.2f}")
        table.add_row(*cells)
    _console().print(table)
    if not rows:
        _console().print("no measured step has a predicted step with the same agent count")
