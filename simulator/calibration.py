"""Predicted against measured: the simulator's steps beside the load generator's steps of a real run
(`kvserve bench agents` JSON: steps [{agents, ttft_p50, ttft_p95, tok_s_p50, cache_hit, ...}]), as the
ratio predicted / measured per statistic and step."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

COMPARED = (
    "ttft_p50",
    "ttft_p95",
    "ttft_p95_warm",
    "ttft_p95_cold",
    "tok_s_p50",
    "tok_s_p10",
    "cache_hit",
    "errors",
    "passed",
)


def load_measured(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("steps"), list):
        raise ValueError(f"{path}: not a load generator result (no 'steps' list)")
    return data


def _ratio(predicted: Any, measured: Any) -> float | None:
    if isinstance(predicted, bool) or isinstance(measured, bool):
        return None
    if not isinstance(predicted, (int, float)) or not isinstance(measured, (int, float)) or measured == 0:
        return None
    return round(predicted / measured, 3)


def compare_steps(predicted: Sequence[dict[str, Any]], measured: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per measured step that has a predicted step of the same agent count: every compared statistic as
    {measured, predicted, ratio}."""
    by_agents = {step["agents"]: step for step in predicted}
    rows: list[dict[str, Any]] = []
    for real in measured:
        guess = by_agents.get(real.get("agents"))
        if guess is None:
            continue
        row: dict[str, Any] = {"agents": real["agents"]}
        for name in COMPARED:
            if name in real or name in guess:
                row[name] = {
                    "measured": real.get(name),
                    "predicted": guess.get(name),
                    "ratio": _ratio(guess.get(name), real.get(name)),
                }
        rows.append(row)
    return rows
