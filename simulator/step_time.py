"""How long one engine step takes on the GPU, fitted to the engine benchmark's measurements
(bench/results/engine-h200.json, written by bench/engine.py).

Prefill. A chunk of n new tokens over c tokens already in the KV pool costs

    alpha * n              the weights (matmuls), linear in the tokens
  + beta * n * n / 2       attention inside the chunk (causal: each token sees half the chunk on average)
  + gamma * n * c          attention to the cached context (gathered from the paged pool)

plus `overhead` once per step (kernel launches, sampling). The chunked prefill of a long prompt is one such
chunk per step, c growing by the chunk each time. beta and gamma are separate because the engine runs the
two kinds of attention differently (a flash-friendly causal SDPA vs a masked SDPA over gathered blocks);
the benchmark's cold prefills pin alpha and beta, its warm TTFTs (1K new tokens over 32K and 100K cached)
pin gamma, and its cold 32K/100K TTFTs (chunked) tie them together. The four coefficients are a
non-negative least-squares fit of all seven points, each weighted by 1/measured (relative error).

Decode. One step of B sequences is launch-bound at small batch (the ms/step at batch 1 and 16 are equal:
the CPU issues kernels slower than the GPU runs them) and grows with the KV it reads beyond that:

    decode_s = max(floor, base + per_kv_token * B * max_context)

B * max_context because the decode attention gathers every sequence's blocks padded to the longest. The
benchmark measures one context (4K), so the split between batch and context is this assumption, not a
measurement. floor is the batch-1 step; base and per_kv_token are a least-squares line through the points
above the floor (they are not launch-bound). A step that also prefills pays the prefill cost plus
per_kv_token * B * max_context for its decodes (the floor is already in the prefill overhead).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

LAUNCH_BOUND_MARGIN = 1.1  # a decode point within 10% of the batch-1 step counts as launch-bound


@dataclass(frozen=True)
class StepTimeModel:
    overhead_s: float  # per step that prefills
    alpha_s: float  # per new token
    beta_s: float  # per new token x half the chunk
    gamma_s: float  # per new token x cached context token
    decode_floor_s: float
    decode_base_s: float
    decode_kv_token_s: float  # per (sequence x padded context token) read in a decode step
    max_num_batched_tokens: int  # the chunk size the measurements ran with

    def chunk_s(self, new_tokens: int, context: int) -> float:
        """The model work of one prefill chunk (without the step's overhead)."""
        n = float(new_tokens)
        return self.alpha_s * n + self.beta_s * n * n / 2 + self.gamma_s * n * context

    def prefill_s(self, new_tokens: int, cached: int = 0, chunk: int | None = None) -> float:
        """A whole prefill run alone, chunk by chunk (one step each): the TTFT of an idle engine."""
        chunk = chunk or self.max_num_batched_tokens
        total = 0.0
        done = 0
        while done < new_tokens:
            n = min(chunk, new_tokens - done)
            total += self.overhead_s + self.chunk_s(n, cached + done)
            done += n
        return total

    def decode_step_s(self, batch: int, max_context: int) -> float:
        if batch <= 0:
            return 0.0
        return max(self.decode_floor_s, self.decode_base_s + self.decode_kv_token_s * batch * max_context)

    def step_s(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """One step: prefill chunks as (new tokens, cached context before the chunk), decodes by context."""
        if not prefills:
            return self.decode_step_s(len(decode_contexts), max(decode_contexts, default=0))
        kv = len(decode_contexts) * max(decode_contexts, default=0)
        return self.overhead_s + sum(self.chunk_s(n, c) for n, c in prefills) + self.decode_kv_token_s * kv

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --- the fit ---


def _prefill_row(new_tokens: int, cached: int, chunk: int) -> list[float]:
    """Design-matrix row (overhead, alpha, beta, gamma) of a chunked prefill: the sums over its chunks."""
    row = [0.0, 0.0, 0.0, 0.0]
    done = 0
    while done < new_tokens:
        n = min(chunk, new_tokens - done)
        c = cached + done
        row[0] += 1
        row[1] += n
        row[2] += n * n / 2
        row[3] += n * c
        done += n
    return row


def prefill_points(results: dict[str, Any]) -> list[tuple[int, int, float]]:
    """The measured prefill runs as (new tokens, cached tokens, seconds)."""
    points = [(int(r["tokens"]), 0, float(r["seconds"])) for r in results.get("prefill", [])]
    for r in results.get("ttft", []):
        context, new = int(r["context"]), int(r["new_tokens"])
        points.append((context + new, 0, float(r["cold_s"])))
        points.append((new, int(r.get("warm_cached_tokens", context)), float(r["warm_s"])))
    return points


def decode_points(results: dict[str, Any]) -> list[tuple[int, int, float]]:
    """The measured decode steps as (batch, context, seconds)."""
    return [(int(r["batch"]), int(r["context"]), float(r["step_ms"]) / 1e3) for r in results.get("decode", [])]


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| subject to x >= 0, by trying every support (4 unknowns: 16 small solves)."""
    best: np.ndarray | None = None
    best_residual = float("inf")
    columns = a.shape[1]
    for size in range(columns, 0, -1):
        for support in itertools.combinations(range(columns), size):
            solution, *_ = np.linalg.lstsq(a[:, support], b, rcond=None)
            if (solution < 0).any():
                continue
            x = np.zeros(columns)
            x[list(support)] = solution
            residual = float(np.linalg.norm(a @ x - b))
            if residual < best_residual:
                best, best_residual = x, residual
    assert best is not None  # a single column with a non-negative fit always exists for positive times
    return best


def fit_step_time(results: dict[str, Any]) -> StepTimeModel:
    """The step-time model that best fits an engine benchmark result (bench/engine.py's JSON)."""
    chunk = int(results.get("settings", {}).get("max_num_batched_tokens", 32768))
    prefill = prefill_points(results)
    decode = decode_points(results)
    if not prefill or not decode:
        raise ValueError("the engine results need prefill and decode measurements")
    a = np.array([_prefill_row(n, cached, chunk) for n, cached, _ in prefill])
    b = np.array([seconds for *_, seconds in prefill])
    weights = 1.0 / b  # relative error: a 10 s point must not drown a 60 ms one
    overhead, alpha, beta, gamma = _nonnegative_lstsq(a * weights[:, None], b * weights)

    floor = min(seconds for batch, _, seconds in decode if batch == min(p[0] for p in decode))
    bound = [(batch * context, seconds) for batch, context, seconds in decode if seconds > floor * LAUNCH_BOUND_MARGIN]
    if len(bound) >= 2:
        kv = np.array([k for k, _ in bound], dtype=float)
        secs = np.array([s for _, s in bound])
        slope, base = np.polyfit(kv, secs, 1)
        slope = max(float(slope), 0.0)
    elif bound:  # one point: a line from the floor's knee at zero KV through it
        slope = (bound[0][1] - floor) / bound[0][0]
        base = floor
    else:  # launch-bound everywhere measured
        slope, base = 0.0, floor
    return StepTimeModel(
        overhead_s=float(overhead),
        alpha_s=float(alpha),
        beta_s=float(beta),
        gamma_s=float(gamma),
        decode_floor_s=float(floor),
        decode_base_s=float(base),
        decode_kv_token_s=float(slope),
        max_num_batched_tokens=chunk,
    )


def fit_report(model: StepTimeModel, results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every measured point beside the model's prediction (for the printed table and the tests)."""
    rows: list[dict[str, Any]] = []
    for new, cached, seconds in prefill_points(results):
        predicted = model.prefill_s(new, cached)
        rows.append({"kind": "prefill", "new": new, "cached": cached, "measured_s": seconds, "model_s": predicted})
    for batch, context, seconds in decode_points(results):
        predicted = model.decode_step_s(batch, context)
        rows.append({"kind": "decode", "batch": batch, "context": context, "measured_s": seconds, "model_s": predicted})
    return rows


def load_engine_results(path: str | Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
