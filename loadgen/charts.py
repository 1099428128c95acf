"""PNG charts of a run's steps: TTFT (warm and cold side by side), per-agent tok/s, cache hit by tier.

matplotlib is imported here only, when drawing: machines that only run the generator need not have it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from loadgen.report import Thresholds


def _values(steps: Sequence[dict[str, Any]], key: str) -> list[float]:
    return [float(step[key]) if step.get(key) is not None else 0.0 for step in steps]


def draw_charts(
    steps: Sequence[dict[str, Any]], prefix: str | Path, thresholds: Thresholds = Thresholds(), title: str = ""
) -> list[Path]:
    """Write <prefix>-ttft.png, <prefix>-tok_s.png and <prefix>-cache.png; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    labels = [str(step["agents"]) for step in steps]
    x = list(range(len(steps)))
    paths: list[Path] = []

    def bars(ax: Any, series: list[tuple[str, list[float], str]]) -> None:
        width = 0.8 / len(series)
        for i, (name, values, color) in enumerate(series):
            ax.bar([p - 0.4 + width * (i + 0.5) for p in x], values, width, label=name, color=color)
        ax.set_xticks(x, labels)
        ax.set_xlabel("concurrent agents")

    def save(fig: Any, ax: Any, name: str, ylabel: str) -> None:
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title} {name}".strip())
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = prefix.with_name(f"{prefix.name}-{name}.png")
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars(
        ax,
        [
            ("warm p50", _values(steps, "ttft_p50_warm"), "#9ecae1"),
            ("warm p95", _values(steps, "ttft_p95_warm"), "#3182bd"),
            ("cold p50", _values(steps, "ttft_p50_cold"), "#fdae6b"),
            ("cold p95", _values(steps, "ttft_p95_cold"), "#e6550d"),
        ],
    )
    ax.axhline(thresholds.ttft_p95_s, color="red", linestyle="--", linewidth=1, label="p95 bar")
    save(fig, ax, "ttft", "time to first token (s)")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    bars(ax, [("p50", _values(steps, "tok_s_p50"), "#31a354"), ("p10", _values(steps, "tok_s_p10"), "#a1d99b")])
    ax.axhline(thresholds.tok_s_p50, color="red", linestyle="--", linewidth=1, label="p50 bar")
    ax.axhline(thresholds.tok_s_p10, color="orange", linestyle=":", linewidth=1, label="p10 bar")
    save(fig, ax, "tok_s", "output tokens/s per agent")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    l0 = _values(steps, "cache_hit_l0")
    l1 = _values(steps, "cache_hit_l1")
    ax.bar(x, l0, 0.5, label="L0 (GPU)", color="#756bb1")
    ax.bar(x, l1, 0.5, bottom=l0, label="L1 (host)", color="#bcbddc")
    ax.plot(x, _values(steps, "cache_hit"), "ko", label="cache hit (usage)")
    ax.plot(x, _values(steps, "expected_cache_hit"), "k_", markersize=20, label="trace's reuse")
    bar = [None if v is None else v * thresholds.cache_hit_of_optimum for v in _values(steps, "expected_cache_hit")]
    ax.plot(x, bar, "r_", markersize=20, label=f"bar ({thresholds.cache_hit_of_optimum:.0%} of the trace's reuse)")
    ax.set_xticks(x, labels)
    ax.set_xlabel("concurrent agents")
    ax.set_ylim(0, 1.05)
    save(fig, ax, "cache", "input tokens from cache")
    return paths


def main(argv: list[str]) -> int:
    """python -m loadgen.charts RESULTS.json [PREFIX]: draw a results file's charts (on a machine with
    matplotlib); the prefix defaults to the file's path without .json."""
    import json
    import sys

    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__, file=sys.stderr)
        return 0 if argv else 2
    results = json.loads(Path(argv[0]).read_text())
    thresholds = Thresholds.from_record(results["thresholds"]) if "thresholds" in results else Thresholds()
    prefix = argv[1] if len(argv) > 1 else str(Path(argv[0]).with_suffix(""))
    for path in draw_charts(results["steps"], prefix, thresholds, title=str(results.get("model", ""))):
        print(path)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
