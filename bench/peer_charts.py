"""PNG charts of a side-by-side run's peer.json (bench/peer_results.py): the engine-level speed ratio per measure
against the 0.95 target, and both sides' TTFT p95 and per-agent tok/s p50 per agent count against the bar.

matplotlib is imported here only, when drawing (the GPU image has it; the tables need only rich).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

COLORS = {"ours": "#3182bd", "vllm": "#e6550d"}
NAMES = {"ours": "kvserve", "vllm": "vLLM"}


def draw(result: dict[str, Any], prefix: str | Path) -> list[Path]:
    """Write <prefix>-engine.png and <prefix>-agents.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix = Path(prefix)
    paths: list[Path] = []
    rows = [row for row in result["engine"] if row["ratio"] is not None]
    if rows:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        ax.barh([row["measure"] for row in rows], [row["ratio"] for row in rows], color=COLORS["ours"])
        ax.axvline(result["target"], color="black", linestyle="--", label=f"target {result['target']}")
        ax.axvline(1.0, color="grey", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_xlabel("vLLM seconds / kvserve seconds (above 1: kvserve faster)")
        ax.set_title(f"engine level, {result['gpu']}, {result['date']}")
        ax.legend(fontsize="small")
        fig.tight_layout()
        paths.append(prefix.with_name(f"{prefix.name}-engine.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)

    steps = result["agents"]
    if steps:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
        for side in ("ours", "vllm"):
            points = [(row["agents"], row[side]) for row in steps if row[side] and not row[side].get("unfinished")]
            x = [agents for agents, _ in points]
            left.plot(x, [s["ttft_p95"] or 0 for _, s in points], "o-", color=COLORS[side], label=NAMES[side])
            right.plot(x, [s["tok_s_p50"] or 0 for _, s in points], "o-", color=COLORS[side], label=NAMES[side])
            # A step the side did not finish has no measures: a cross on the axis says it failed
            stopped = [row["agents"] for row in steps if row[side] and row[side].get("unfinished")]
            for ax in (left, right):
                if stopped:
                    ax.plot(stopped, [0] * len(stopped), "x", color=COLORS[side], markersize=10,
                            label=f"{NAMES[side]}: did not finish")  # fmt: skip
        left.axhline(15.0, color="black", linestyle="--", label="bar: p95 <= 15 s")
        right.axhline(20.0, color="black", linestyle="--", label="bar: p50 >= 20")
        left.set_ylabel("TTFT p95 (s)")
        right.set_ylabel("per-agent output tok/s p50")
        for ax in (left, right):
            ax.set_xlabel("concurrent agents")
            ax.legend(fontsize="small")
        fig.suptitle(f"agent level, Claude Code traces, {result['gpu']}, {result['date']}")
        fig.tight_layout()
        paths.append(prefix.with_name(f"{prefix.name}-agents.png"))
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
