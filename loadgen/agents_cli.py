"""`kvserve bench agents`: N concurrent agents replay traces against the gateway, in steps of increasing N;
per step TTFT (warm/cold), per-agent and per-call tok/s, cache hit (L0/L1), errors and the verdict; JSON, PNGs,
a table.

    kvserve bench agents --url http://127.0.0.1:8080 --agents 2,4,8 --duration 300
    kvserve bench agents --trace mooncake --agents 16 --turns 20 --think-time trace
    kvserve bench agents --synthetic 128k --agents 4 --turns 8 --context-scale 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from loadgen.agent import ThinkTime
from loadgen.content import ContentBuilder
from loadgen.gateway_info import calibrate, count_tokens, probe_context, served_model
from loadgen.provenance import checkout_record
from loadgen.report import (
    TABLE_COLUMNS,
    add_pass_bar_arguments,
    largest_passing,
    step_row,
    step_stats,
    thresholds_from,
)
from loadgen.runner import RunSettings, StepSettings, run_step
from loadgen.workload import SYNTHETIC_TARGETS, fitting_factor, load_workload, turns_replayed


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve bench agents", description=__doc__.split("\n\n")[0])
    server = parser.add_argument_group("server")
    server.add_argument("--url", default="http://127.0.0.1:8080", help="the gateway's base URL")
    server.add_argument("--api", choices=("anthropic", "openai"), default="anthropic", help="/v1/messages or chat")
    server.add_argument("--api-key", default=os.environ.get("ANTHROPIC_API_KEY", ""), help="default $ANTHROPIC_API_KEY")
    server.add_argument("--model", default="", help="model name to send (default: the first of GET /v1/models)")
    server.add_argument("--max-context", type=int, default=None, help="served context (default: asked of the gateway)")
    server.add_argument("--request-timeout", type=float, default=900.0, help="seconds per call")

    work = parser.add_argument_group("workload")
    work.add_argument("--trace", choices=("claude_code", "mooncake"), default="claude_code")
    work.add_argument("--trace-path", default=None, help="a trace dir or file (default under /work/shared/traces)")
    work.add_argument("--synthetic", choices=tuple(SYNTHETIC_TARGETS), default=None, help="synthetic target context")
    work.add_argument("--synthetic-turns", type=int, default=10, help="turns per synthetic agent")
    work.add_argument("--context-scale", type=float, default=None, help="input size factor (default: fit context)")
    work.add_argument("--think-time", default="3", help="seconds between an agent's calls, or 'trace'")
    work.add_argument("--max-think", type=float, default=120.0, help="cap on trace think times (s)")
    work.add_argument("--max-output-tokens", type=int, default=None, help="cap on the trace's output lengths")
    work.add_argument("--no-ignore-eos", action="store_true", help="let the model stop at EOS")
    work.add_argument(
        "--messages",
        action="store_true",
        help="send each call as a conversation (a user message per turn, a fixed assistant reply between), as a "
        "coding agent does; default: one growing user message",
    )
    work.add_argument("--seed", type=int, default=0, help="id namespace and synthetic draws; vary it per run")

    steps = parser.add_argument_group("steps")
    steps.add_argument("--agents", default="2,4,8", help="comma-separated agent counts, one step each")
    steps.add_argument("--duration", type=float, default=None, help="seconds per step (default 300 without --turns)")
    steps.add_argument("--turns", type=int, default=None, help="calls per agent per step")
    steps.add_argument("--stagger", type=float, default=0.0, help="spread agent starts over this many seconds")

    add_pass_bar_arguments(parser)

    out = parser.add_argument_group("output")
    out.add_argument("--out", default="agents-bench.json", help="JSON results file")
    out.add_argument("--charts", default=None, help="PNG prefix (default: --out without .json)")
    out.add_argument("--no-charts", action="store_true")
    out.add_argument("--quiet", action="store_true", help="no live progress display")
    return parser


def _agent_counts(text: str) -> list[int]:
    counts = [int(part) for part in text.split(",") if part.strip()]
    if not counts or min(counts) < 1:
        raise ValueError("--agents needs positive counts, e.g. 2,4,8")
    return counts


def _think(args: argparse.Namespace) -> ThinkTime:
    if args.think_time == "trace":
        return ThinkTime(fixed=None, cap_s=args.max_think)
    try:
        seconds = float(args.think_time)
    except ValueError:
        raise ValueError("--think-time takes seconds or 'trace'") from None
    if seconds < 0:
        raise ValueError("--think-time must not be negative")
    return ThinkTime(fixed=seconds, cap_s=args.max_think)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    err = Console(stderr=True, width=None if sys.stderr.isatty() else 160)
    try:
        agent_counts = _agent_counts(args.agents)
        think = _think(args)
        sessions = load_workload(
            args.trace, args.trace_path, args.synthetic, max(agent_counts), args.synthetic_turns, args.seed
        )
    except (OSError, ValueError) as exc:
        err.print(f"[red]error:[/red] {exc}")
        return 2
    duration = args.duration if args.duration is not None or args.turns is not None else 300.0
    args.url = args.url.rstrip("/")
    headers = {"x-api-key": args.api_key, "authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        with httpx.Client(base_url=args.url, headers=headers, timeout=60) as client:
            model, listed_context = served_model(client)
            model = args.model or model
            max_context = args.max_context or listed_context or probe_context(client, model)
            if max_context is None:
                err.print("[red]error:[/red] the gateway does not say its context window: pass --max-context")
                return 2
            tokens_per_word, template_tokens = calibrate(client, model)
            turns = turns_replayed(sessions, max(agent_counts), args.turns)
            factor = args.context_scale or fitting_factor(turns, max_context, template_tokens, args.max_output_tokens)
            content = ContentBuilder(tokens_per_word=tokens_per_word, factor=factor, messages=args.messages)
            first = next(session.turns[0] for session in sessions if session.turns)
            check = {
                "expected": content.expected_tokens(first) + template_tokens,
                "counted": count_tokens(client, model, content.prompt(first)),
            }
    except httpx.HTTPError as exc:
        err.print(f"[red]error:[/red] the gateway at {args.url} did not answer: {exc}")
        return 2
    err.print(
        f"{len(sessions)} sessions, model {model} (context {max_context}), context scale {factor:.4g}, "
        f"{tokens_per_word:.3f} tokens/word, first prompt {check['counted']} tokens (aimed at {check['expected']})"
    )
    thresholds = thresholds_from(args)
    run = RunSettings(
        base_url=args.url,
        api=args.api,
        model=model,
        content=content,
        think=think,
        max_context=max_context,
        max_output_tokens=args.max_output_tokens,
        ignore_eos=not args.no_ignore_eos,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        template_tokens=template_tokens,
        api_key=args.api_key,
        live=not args.quiet,
    )
    steps: list[dict[str, Any]] = []
    requests: list[dict[str, Any]] = []
    interrupted = False
    for index, agents in enumerate(agent_counts):
        step = StepSettings(index=index, agents=agents, duration_s=duration, turns=args.turns, stagger_s=args.stagger)
        try:
            result = run_step(sessions, step, run)
        except KeyboardInterrupt:  # keep what the finished steps measured
            err.print(f"[yellow]interrupted during the {agents}-agent step: it is left out[/yellow]")
            interrupted = True
            break
        stats = step_stats(result.records, agents, result.cached_by_tier, result.wall_s, thresholds)
        steps.append(stats)
        requests += [{"step": index, "agents": agents, **dataclasses.asdict(r)} for r in result.records]
        verdict = "PASS" if stats["passed"] else "fail: " + ", ".join(stats["failed"])
        rates = f"tok/s p50 {stats['tok_s_p50']} per agent, {stats['request_tok_s_p50']} per call"
        err.print(f"step {agents} agents: {stats['requests']} calls, {rates}, {verdict}")

    best = largest_passing(steps)
    results = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **checkout_record(),
        "url": args.url,
        "api": args.api,
        "model": model,
        "max_context": max_context,
        "workload": {
            "trace": None if args.synthetic else args.trace,
            "trace_path": args.trace_path,
            "synthetic": args.synthetic,
            "sessions": len(sessions),
            "conversation": "messages" if args.messages else "one_message",
        },
        "context_scale": factor,
        "tokens_per_word": round(tokens_per_word, 4),
        "template_tokens": template_tokens,
        "calibration_check": check,
        "think_time": args.think_time,
        "duration_s": duration,
        "turns": args.turns,
        "ignore_eos": not args.no_ignore_eos,
        "max_output_tokens": args.max_output_tokens,
        "seed": args.seed,
        "thresholds": dataclasses.asdict(thresholds),
        "steps": steps,
        "largest_passing": best,
        "interrupted": interrupted,
        "requests": requests,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    _print_table(steps, best)
    charts: list[Path] = []
    if not args.no_charts:
        from loadgen.charts import draw_charts

        prefix = args.charts or str(out.with_suffix(""))
        try:
            charts = draw_charts(steps, prefix, thresholds, title=f"{model}, {args.synthetic or args.trace}:")
        except ImportError:  # the GPU image has no matplotlib: the JSON is there, draw elsewhere
            err.print("no charts: matplotlib is not installed (python -m loadgen.charts RESULTS.json draws them)")
    err.print(f"wrote {out}" + "".join(f", {path}" for path in charts))
    return 130 if interrupted else 0


def _print_table(steps: list[dict[str, Any]], best: int | None) -> None:
    table = Table(title="agent benchmark")
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="right" if column != "verdict" else "left")
    for stats in steps:
        table.add_row(*step_row(stats))
    console = Console(width=None if sys.stdout.isatty() else 160)  # a log file gets the whole table
    console.print(table)
    console.print(f"largest passing N: {best if best is not None else 'none'}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
