"""The gateway's prompt tokenizing per agent call, whole against the segment cache (gateway/prompt/segment_cache.py),
on Claude Code conversations at the traces' real size: CPU only, our own component before and after (no vLLM here).

Each agent replays its trace's turns as the conversations `kvserve bench agents --messages` sends (loadgen's own
builder), as Claude Code sends one: the system prompt (the first block), then per turn a user message with the
blocks new since the previous call (its tool results), the fixed assistant reply between them. A turn whose blocks
do not extend the previous turn's (the trace rewrote its context) starts the conversation over. Each call's prompt is
rendered by the
gateway's PromptFormat for the served shape and encoded by ServedModel.encode twice: with the cache (as the gateway
now does) and whole (tokenize_cache_tokens 0); the ids must agree, or the run fails.

    python bench/tokenize_cache.py --agents 4 --turns 24 --out bench/results/<date>-cpu-tokenize-cache/result.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from contracts.config import TOKENIZE_CACHE_TOKENS  # noqa: E402
from gateway.prompt.chat import ChatMessage, ChatRequest  # noqa: E402
from gateway.prompt.prompt_format import PromptFormat  # noqa: E402
from gateway.prompt.served_model import ServedModel  # noqa: E402
from loadgen.content import ContentBuilder, calibration_text, turn_ends  # noqa: E402
from loadgen.provenance import checkout_record  # noqa: E402
from loadgen.traces import AgentTrace, load_claude_code  # noqa: E402
from loadgen.wire import conversation_of  # noqa: E402
from protos import rank_worker_pb2 as pb  # noqa: E402

TRACES = ROOT.parent / "shared" / "traces" / "claude_code"


def served_model(shape: Path, cache_tokens: int) -> ServedModel:
    tokenizer_json = (shape / "tokenizer.json").read_text()
    template = json.loads((shape / "tokenizer_config.json").read_text()).get("chat_template", "")
    info = pb.ModelInfoResponse(
        served_model_name=shape.name,
        model_id=shape.name,
        max_model_len=1 << 21,
        tokenizer_json=tokenizer_json,
        chat_template=template,
        bos_token_id=-1,
    )
    return ServedModel.from_info(info, tokenize_cache_tokens=cache_tokens)


def tokens_per_word(model: ServedModel) -> float:
    words = 20_000
    return len(model.encode(calibration_text(words))) / words


def conversations(agent: AgentTrace, turns: int, content: ContentBuilder):
    """Per call of the agent: the messages `kvserve bench agents --messages` sends (loadgen's own builder)."""
    ends: tuple[int, ...] = ()
    previous: tuple[int, ...] = ()
    for turn in agent.turns[:turns]:
        ends, previous = turn_ends(previous, ends, turn), turn.hash_ids
        prompt = content.prompt(turn, None, ends)
        system = [ChatMessage(role="system", content=prompt.system)] if prompt.system else []
        yield system + [ChatMessage(role=m["role"], content=m["content"]) for m in conversation_of(prompt)]


def timed(model: ServedModel, text: str) -> tuple[list[int], float]:
    started = time.perf_counter()
    ids = model.encode(text)
    return ids, time.perf_counter() - started


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--traces", default=str(TRACES))
    parser.add_argument("--shape", default=str(ROOT / "bench" / "shapes" / "dsv2-lite-chat"))
    parser.add_argument("--agents", type=int, default=4, help="the traces' longest sessions, this many")
    parser.add_argument("--turns", type=int, default=24)
    parser.add_argument("--context-scale", type=float, default=1.0)
    parser.add_argument("--out", default="", help="JSON result (a chart beside it, .png)")
    args = parser.parse_args(argv)

    shape = Path(args.shape)
    cached, whole = served_model(shape, TOKENIZE_CACHE_TOKENS), served_model(shape, 0)
    prompts = PromptFormat.for_model(cached)
    per_word = tokens_per_word(whole)
    content = ContentBuilder(tokens_per_word=per_word, factor=args.context_scale, messages=True)
    agents = sorted(load_claude_code(args.traces), key=lambda a: -max((t.input_tokens for t in a.turns), default=0))
    agents = [a for a in agents if len(a.turns) >= args.turns][: args.agents]
    calls = []
    for agent in agents:
        for turn, messages in enumerate(conversations(agent, args.turns, content)):
            text = prompts.render(ChatRequest(model=cached.name, messages=messages))
            ids_whole, whole_s = timed(whole, text)
            ids_cached, cached_s = timed(cached, text)
            if ids_cached != ids_whole:
                print(f"{agent.name} turn {turn}: the cached ids differ from the whole prompt's", file=sys.stderr)
                return 1
            calls.append(
                {
                    "agent": agent.name,
                    "turn": turn,
                    "messages": len(messages),
                    "prompt_tokens": len(ids_whole),
                    "whole_ms": round(whole_s * 1000, 2),
                    "cached_ms": round(cached_s * 1000, 2),
                }
            )
    warm = [c for c in calls if c["turn"] > 0]
    summary = {
        "calls": len(calls),
        "prompt_tokens_p50": percentile([c["prompt_tokens"] for c in calls], 0.5),
        "prompt_tokens_max": max(c["prompt_tokens"] for c in calls),
        "whole_ms_p50": percentile([c["whole_ms"] for c in warm], 0.5),
        "whole_ms_p95": percentile([c["whole_ms"] for c in warm], 0.95),
        "cached_ms_p50": percentile([c["cached_ms"] for c in warm], 0.5),
        "cached_ms_p95": percentile([c["cached_ms"] for c in warm], 0.95),
        "whole_s_total": round(sum(c["whole_ms"] for c in calls) / 1000, 2),
        "cached_s_total": round(sum(c["cached_ms"] for c in calls) / 1000, 2),
    }
    summary["speedup_p50"] = round(summary["whole_ms_p50"] / max(summary["cached_ms_p50"], 1e-9), 1)
    _print(calls, summary)
    if args.out:
        result = {
            "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            **checkout_record(),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
            "settings": {
                "shape": shape.name,
                "agents": [a.name for a in agents],
                "turns": args.turns,
                "context_scale": args.context_scale,
                "assistant_reply": "loadgen.content.ASSISTANT_REPLY",
                "tokens_per_word": round(per_word, 4),
                "cache_tokens": cached.segments.capacity_tokens if cached.segments else 0,
                "timing": "ServedModel.encode per call, whole then cached, one process; warm = every call after an "
                "agent's first",
            },
            "summary": summary,
            "calls": calls,
        }
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        _chart(calls, out.with_suffix(".png"))
        print(f"wrote {out}")
    return 0


def _print(calls: list[dict], summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="gateway tokenizing per agent call: whole prompt vs segment cache")
    for column in ("agent", "calls", "prompt tokens p50 / max", "whole ms p50 / p95", "cached ms p50 / p95"):
        table.add_column(column)
    for agent in dict.fromkeys(c["agent"] for c in calls):
        mine = [c for c in calls if c["agent"] == agent]
        warm = [c for c in mine if c["turn"] > 0] or mine

        def spread(key: str, rows: list[dict] = warm) -> str:
            values = [c[key] for c in rows]
            return f"{percentile(values, 0.5):.1f} / {percentile(values, 0.95):.1f}"

        tokens = [c["prompt_tokens"] for c in mine]
        table.add_row(
            agent, str(len(mine)), f"{percentile(tokens, 0.5)} / {max(tokens)}", spread("whole_ms"), spread("cached_ms")
        )
    Console().print(table)
    print(json.dumps(summary))


def _chart(calls: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    tokens = [c["prompt_tokens"] / 1000 for c in calls]
    axis.scatter(tokens, [c["whole_ms"] for c in calls], s=10, label="whole prompt")
    axis.scatter(tokens, [c["cached_ms"] for c in calls], s=10, label="segment cache")
    axis.set_xlabel("prompt tokens (K)")
    axis.set_ylabel("ms to tokenize")
    axis.set_yscale("log")
    axis.legend()
    axis.set_title("gateway tokenizing per agent call")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    raise SystemExit(main())
