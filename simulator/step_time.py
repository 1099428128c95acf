"""How long one engine step takes on the GPU, fitted to measurements: the engine benchmark
(simulator/results/engine-h200.json, a bench/engine.py run) and, where there is one, the decode probe
(simulator/results/decode-h200.json, simulator/decode_probe.py).

Prefill. A chunk of n new tokens over c tokens already in the KV pool costs

    alpha * n              the weights (matmuls), linear in the tokens
  + beta * n * n / 2       attention inside the chunk (causal: each token sees half the chunk on average)
  + gamma * n * c          attention to the cached context (gathered from the paged pool)
  + delta * c              the cached context once per chunk, whatever its size (prefix_token_s: reading the
                           prefix's pages, and for MLA expanding its latents into per-head K/V for every chunk)

plus `overhead` once per step (kernel launches, sampling). The chunked prefill of a long prompt is one such
chunk per step, c growing by the chunk each time. beta and gamma are separate because the engine runs the
two kinds of attention differently (a flash-friendly causal SDPA vs a masked SDPA over gathered blocks);
the benchmark's cold prefills pin alpha and beta, its warm TTFTs (1K new tokens over 32K and 100K cached),
its warm prefills (8K over 32K, 4K over 100K, where measured) and the probe's 8K chunk over 64K cached pin
gamma and delta, and the cold 32K/100K TTFTs (chunked) tie them together. The five coefficients are a
non-negative least-squares fit of all these points, each weighted by 1/measured (relative error). On
DeepSeek-V2-Lite (simulator/results/engine-dsv2-lite-h200.json) delta is 0.3 us a cached token (120 ms a chunk
over 400K) and without it the worst point was 17% off, with it 7%; on llama-8b 0.25 us with the decode probe's
8K chunk over 64K (0.03 us from the engine benchmark alone).

Decode. One step of B sequences is launch-bound at small batch and beyond that grows with the KV it reads:

    decode_s = max(floor, base + per_kv_token * kv + per_pad_token * (B * longest - kv))

kv is the tokens of all B contexts; B * longest - kv the padding. The engine once gathered every
sequence's blocks padded to the longest (padding cost nearly as much as real KV); since decode steps are
replayed from CUDA graphs and attention reads the pool in place (rank_worker/model/attention/decode_kernel.py),
the probe puts the padding term at a quarter of the KV term (empty split-K slices still launch) and the
floor at ~8 ms. The probe measured B x context from 4x4K to 4x128K and batches of one long context among
short ones. Without a probe, only the benchmark's 4K points exist: padding is then costed as real KV.
floor is the median of the launch-bound points (those under 1.4 x the fastest); base and the per-token
costs a least-squares fit of the others.
A step that also prefills pays the prefill cost plus the per-token KV terms of its decodes (the probe's
mixed steps add up that way; the floor is already in the prefill overhead).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

LAUNCH_BOUND_MARGIN = 1.4  # a decode point under 1.4 x the fastest one counts as launch-bound (timing noise)


@dataclass(frozen=True)
class StepTimeModel:
    overhead_s: float  # per step that prefills
    alpha_s: float  # per new token
    beta_s: float  # per new token x half the chunk
    gamma_s: float  # per new token x cached context token
    decode_floor_s: float
    decode_base_s: float
    decode_kv_token_s: float  # per context token read in a decode step
    decode_pad_token_s: float  # per padding token (B x longest context - the real ones)
    max_num_batched_tokens: int  # the chunk size the measurements ran with
    prefix_token_s: float = 0.0  # per cached context token, once per chunk (delta)

    def chunk_s(self, new_tokens: int, context: int) -> float:
        """The model work of one prefill chunk (without the step's overhead)."""
        n = float(new_tokens)
        return self.alpha_s * n + self.beta_s * n * n / 2 + self.gamma_s * n * context + self.prefix_token_s * context

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

    def decode_kv_s(self, batch: int, max_context: int, kv_tokens: int | None = None) -> float:
        """What reading the decodes' KV adds to a step (kv_tokens: all contexts; default all of max_context)."""
        padded = batch * max_context
        kv = padded if kv_tokens is None else kv_tokens
        return self.decode_kv_token_s * kv + self.decode_pad_token_s * (padded - kv)

    def decode_step_s(self, batch: int, max_context: int, kv_tokens: int | None = None) -> float:
        """A step of decodes only."""
        if batch <= 0:
            return 0.0
        return max(self.decode_floor_s, self.decode_base_s + self.decode_kv_s(batch, max_context, kv_tokens))

    def step_s(self, prefills: Sequence[tuple[int, int]], decode_contexts: Sequence[int]) -> float:
        """One step: prefill chunks as (new tokens, cached context before the chunk), decodes by context."""
        batch, longest, kv = len(decode_contexts), max(decode_contexts, default=0), sum(decode_contexts)
        if not prefills:
            return self.decode_step_s(batch, longest, kv)
        chunks = sum(self.chunk_s(n, c) for n, c in prefills)
        return self.overhead_s + chunks + (self.decode_kv_s(batch, longest, kv) if batch else 0.0)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# --- the fit ---


def _prefill_row(new_tokens: int, cached: int, chunk: int) -> list[float]:
    """Design-matrix row (overhead, alpha, beta, gamma, delta) of a chunked prefill: the sums over its chunks."""
    row = [0.0, 0.0, 0.0, 0.0, 0.0]
    done = 0
    while done < new_tokens:
        n = min(chunk, new_tokens - done)
        c = cached + done
        row[0] += 1
        row[1] += n
        row[2] += n * n / 2
        row[3] += n * c
        row[4] += c
        done += n
    return row


def prefill_points(results: dict[str, Any], probe: dict[str, Any] | None = None) -> list[tuple[int, int, float]]:
    """The measured prefill runs as (new tokens, cached tokens, seconds)."""
    points = [(int(r["tokens"]), 0, float(r["seconds"])) for r in results.get("prefill", [])]
    for r in results.get("ttft", []):
        context, new = int(r["context"]), int(r["new_tokens"])
        points.append((context + new, 0, float(r["cold_s"])))
        points.append((new, int(r.get("warm_cached_tokens", context)), float(r["warm_s"])))
    # bench/engine.py's warm prefills (8K over 32K, 4K over 100K): chunks of other sizes over the same contexts
    for name, r in sorted(results.get("measures", {}).items()):
        if name.startswith("prefill_warm_") and r.get("cached"):
            points.append((int(r["new"]), int(r["cached"]), float(r["seconds"])))
    for r in (probe or {}).get("rows", []):
        if r.get("prefill_new") and not r.get("batch"):
            points.append((int(r["prefill_new"]), int(r["prefill_cached"]), float(r["step_ms"]) / 1e3))
    return points


def decode_points(results: dict[str, Any], probe: dict[str, Any] | None = None) -> list[tuple[int, int, int, float]]:
    """The measured decode steps as (batch, longest context, kv tokens, seconds): the probe's when there is
    one (it measured contexts and padding, and the code as it is now), else the engine benchmark's."""
    rows = [r for r in (probe or {}).get("rows", []) if r.get("batch") and not r.get("prefill_new")]
    if rows:
        return [(int(r["batch"]), int(r["max_context"]), int(r["kv_tokens"]), float(r["step_ms"]) / 1e3) for r in rows]
    return [
        (int(r["batch"]), int(r["context"]), int(r["batch"]) * int(r["context"]), float(r["step_ms"]) / 1e3)
        for r in results.get("decode", [])
    ]


def _nonnegative_lstsq(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| subject to x >= 0, by trying every support (5 unknowns: 31 small solves)."""
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


def fit_step_time(results: dict[str, Any], probe: dict[str, Any] | None = None) -> StepTimeModel:
    """The step-time model that best fits an engine benchmark result (bench/engine.py's JSON) and, if given,
    a decode probe result (simulator/decode_probe.py's JSON)."""
    chunk = int(results.get("settings", {}).get("max_num_batched_tokens", 32768))
    prefill = prefill_points(results, probe)
    decode = decode_points(results, probe)
    if not prefill or not decode:
        raise ValueError("the engine results need prefill and decode measurements")
    a = np.array([_prefill_row(n, cached, chunk) for n, cached, _ in prefill])
    b = np.array([seconds for *_, seconds in prefill])
    weights = 1.0 / b  # relative error: a 10 s point must not drown a 60 ms one
    overhead, alpha, beta, gamma, delta = _nonnegative_lstsq(a * weights[:, None], b * weights)

    fastest = min(seconds for *_, seconds in decode)
    launch_bound = [seconds for *_, seconds in decode if seconds <= fastest * LAUNCH_BOUND_MARGIN]
    floor = float(np.median(launch_bound))
    bound = [
        (batch * longest, kv, seconds)
        for batch, longest, kv, seconds in decode
        if seconds > fastest * LAUNCH_BOUND_MARGIN
    ]
    padded_any = any(padded > kv for padded, kv, _ in bound)
    base, per_kv, per_pad = floor, 0.0, 0.0
    if len(bound) >= 2:
        rows = np.array([[1.0, kv, padded - kv] if padded_any else [1.0, padded, 0.0] for padded, kv, _ in bound])
        secs = np.array([seconds for *_, seconds in bound])
        columns = 3 if padded_any else 2
        solution, *_ = np.linalg.lstsq(rows[:, :columns], secs, rcond=None)
        base, per_kv = float(solution[0]), max(float(solution[1]), 0.0)
        per_pad = max(float(solution[2]), 0.0) if padded_any else per_kv
    elif bound:  # one point: a line from the floor at zero KV through it
        padded, _, seconds = bound[0]
        per_kv = per_pad = (seconds - floor) / padded
    return StepTimeModel(
        overhead_s=float(overhead),
        alpha_s=float(alpha),
        beta_s=float(beta),
        gamma_s=float(gamma),
        decode_floor_s=floor,
        decode_base_s=base,
        decode_kv_token_s=per_kv,
        decode_pad_token_s=per_pad,
        max_num_batched_tokens=chunk,
        prefix_token_s=float(delta),
    )


def fit_report(
    model: StepTimeModel, results: dict[str, Any], probe: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every measured point beside the model's prediction (for the printed table and the tests); the probe's
    mixed steps (a prefill chunk with decodes) are not fitted, only predicted."""
    rows: list[dict[str, Any]] = []
    for new, cached, seconds in prefill_points(results, probe):
        predicted = model.prefill_s(new, cached)
        rows.append({"kind": "prefill", "new": new, "cached": cached, "measured_s": seconds, "model_s": predicted})
    for batch, longest, kv, seconds in decode_points(results, probe):
        predicted = model.decode_step_s(batch, longest, kv)
        row = {"kind": "decode", "batch": batch, "max_context": longest, "kv_tokens": kv}
        rows.append(row | {"measured_s": seconds, "model_s": predicted})
    for r in (probe or {}).get("rows", []):
        if r.get("prefill_new") and r.get("batch"):
            longest, others = int(r["max_context"]), int(r["batch"]) - 1
            rest = int(r["kv_tokens"]) - longest
            contexts = [longest] + [rest // others + (i < rest % others) for i in range(others)]  # sum, longest
            predicted = model.step_s([(int(r["prefill_new"]), int(r["prefill_cached"]))], contexts)
            row = {"kind": "mixed", "new": r["prefill_new"], "cached": r["prefill_cached"], "batch": r["batch"]}
            rows.append(row | {"kv_tokens": r["kv_tokens"], "measured_s": r["step_ms"] / 1e3, "model_s": predicted})
    return rows


def load_engine_results(path: str | Path) -> dict[str, Any]:
    """A JSON result file (the engine benchmark's or the decode probe's)."""
    return json.loads(Path(path).read_text())
