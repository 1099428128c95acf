"""How long an engine step takes, from what it carries: a linear cost fitted online to measured steps.

A step's seconds are predicted as

    step_s                 once per step (launches, sampling, the engine's own work)
  + prefill_step_s         once more when the step carries a prefill chunk (it runs eagerly, not from a graph)
  + decode_row_s           per decoding row
  + decode_kv_token_s      per KV token the decoding rows read (their contexts, summed)
  + prefill_token_s        per prefill token (the matmuls)
  + prefill_attention_s    per unit of prefill attention: over the step's chunks, new x (cached + new / 2)

The scheduler asks how many prefill tokens fit beside a step's decodes within a time budget
(max_chunk_tokens); the engine says what each step carried and how long the model took (observe).

The fit: least squares of each step's relative error, exponentially forgotten (half-life HALF_LIFE_STEPS), with
non-negative coefficients and a ridge prior toward PRIOR. Relative error, so a 10 ms decode step counts as much
as a 500 ms prefill step, and a step made slow by a stall (a JIT compile, a GC pause) has little leverage: its
row, the step's load over its seconds, is small. The prior is PRIOR scaled by one factor fitted first (the same
relative least squares, one unknown), so a prior of the wrong order of magnitude (another GPU, a CPU) is put
right by the first step, and what no step has measured yet (no prefill seen) keeps the prior's proportions.
"""

from __future__ import annotations

import math
from dataclasses import astuple, dataclass

HALF_LIFE_STEPS = 200  # a step's weight halves after this many further steps (a few seconds of decoding)
PRIOR_WEIGHT = 0.1  # the prior counts as a tenth of a measured step along each coefficient
MAX_CHUNK = 1 << 30  # what max_chunk_tokens says when the fitted cost of a prefill token is zero


@dataclass(frozen=True)
class StepLoad:
    """What one step carries, in the units of the cost's terms."""

    decode_rows: int = 0
    decode_kv_tokens: int = 0  # the decoding rows' contexts (the new token included), summed
    prefill_tokens: int = 0
    prefill_attention: float = 0.0  # over the step's chunks: new x (cached + new / 2)

    def with_decode(self, context: int) -> StepLoad:
        """Plus one decoding row over `context` KV tokens."""
        return StepLoad(
            self.decode_rows + 1, self.decode_kv_tokens + context, self.prefill_tokens, self.prefill_attention
        )

    def with_chunk(self, new_tokens: int, cached: int) -> StepLoad:
        """Plus a prefill chunk of new_tokens over `cached` tokens already in the pool."""
        return StepLoad(
            self.decode_rows,
            self.decode_kv_tokens,
            self.prefill_tokens + new_tokens,
            self.prefill_attention + new_tokens * (cached + new_tokens / 2),
        )

    def features(self) -> tuple[float, ...]:
        """The multipliers of StepCost's fields, in their order."""
        prefills = 1.0 if self.prefill_tokens > 0 else 0.0
        return (
            1.0,
            prefills,
            float(self.decode_rows),
            float(self.decode_kv_tokens),
            float(self.prefill_tokens),
            float(self.prefill_attention),
        )


@dataclass(frozen=True)
class StepCost:
    """Seconds per unit of each term (the fitted model, or the prior)."""

    step_s: float
    prefill_step_s: float
    decode_row_s: float
    decode_kv_token_s: float
    prefill_token_s: float
    prefill_attention_s: float

    def seconds(self, load: StepLoad) -> float:
        return (
            self.step_s
            + (self.prefill_step_s if load.prefill_tokens > 0 else 0.0)
            + self.decode_row_s * load.decode_rows
            + self.decode_kv_token_s * load.decode_kv_tokens
            + self.prefill_token_s * load.prefill_tokens
            + self.prefill_attention_s * load.prefill_attention
        )


# llama-8b in bf16 on one H200 (the engine benchmark and simulator/decode_probe.py): decode steps from graphs
# launch-bound at ~8 ms; 64 rows x 4K 21.5 ms, 128 x 4K 34.8 ms against 4 x 128K 29.1 ms (the same KV: ~45 us a
# row, ~4e-8 s a KV token); a cold 8K chunk 272 ms and one over 64K cached 1064 ms (2.7e-5 s a token, 1.5e-9 s a
# unit of attention); a prefill step's overhead ~10 ms (simulator/step_time.py's fit), ~2 ms over the decode floor.
# A 4K chunk: ~0.13 s; 64 decodes at 4K: ~21 ms. Elsewhere (a CPU, a tiny test model) steps differ by orders of
# magnitude: the fitted scale takes over at the first measured step, the per-term fit within tens.
PRIOR = StepCost(
    step_s=8e-3,
    prefill_step_s=2e-3,
    decode_row_s=4e-5,
    decode_kv_token_s=4e-8,
    prefill_token_s=2.7e-5,
    prefill_attention_s=1.5e-9,
)


class StepCostModel:
    """The step cost, refitted from measured steps (observe) when next asked (coefficients)."""

    def __init__(
        self, prior: StepCost = PRIOR, half_life_steps: float = HALF_LIFE_STEPS, prior_weight: float = PRIOR_WEIGHT
    ) -> None:
        self.prior = prior
        self.prior_weight = prior_weight
        self.decay = 0.5 ** (1.0 / half_life_steps)
        n = len(astuple(prior))
        # Forgotten sums over steps of b b^T and b, b = the step's features over its seconds: the normal equations
        # of sum (coefficients . features / seconds - 1)^2.
        self._gram = [[0.0] * n for _ in range(n)]
        self._moment = [0.0] * n
        self.steps = 0  # steps observed
        self._fitted: StepCost | None = prior

    def observe(self, load: StepLoad, seconds: float) -> None:
        """A step that carried `load` took `seconds` (the model's run, sampling included)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return  # a clock that did not move says nothing about the cost
        row = [x / seconds for x in load.features()]
        decay, gram, moment = self.decay, self._gram, self._moment
        for i, ri in enumerate(row):
            moment[i] = moment[i] * decay + ri
            gram_i = gram[i]
            for j, rj in enumerate(row):
                gram_i[j] = gram_i[j] * decay + ri * rj
        self.steps += 1
        self._fitted = None

    def coefficients(self) -> StepCost:
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted

    def predict(self, load: StepLoad) -> float:
        return self.coefficients().seconds(load)

    def max_chunk_tokens(self, load: StepLoad, cached: int, budget_s: float) -> int:
        """The most new tokens a prefill chunk over `cached` tokens may have for a step carrying `load` plus
        that chunk to be predicted within budget_s (0 when even a token would overrun it)."""
        cost = self.coefficients()
        left = budget_s - cost.seconds(load)
        if load.prefill_tokens == 0:
            left -= cost.prefill_step_s  # the chunk makes it a prefill step
        if left <= 0:
            return 0
        # attention/2 n^2 + (token + attention cached) n <= left
        quadratic = cost.prefill_attention_s / 2
        linear = cost.prefill_token_s + cost.prefill_attention_s * cached
        if quadratic > 0:
            tokens = (math.sqrt(linear * linear + 4 * quadratic * left) - linear) / (2 * quadratic)
        elif linear > 0:
            tokens = left / linear
        else:
            return MAX_CHUNK
        return math.floor(min(tokens, MAX_CHUNK) + 1e-6)  # 1999.9999... (float noise) is 2000

    # --- the fit ---

    def _fit(self) -> StepCost:
        prior = astuple(self.prior)
        gram, moment = self._gram, self._moment
        n = len(prior)
        # The scale: min sum (s prior . features / seconds - 1)^2, i.e. s = (prior . moment) / (prior G prior).
        along = sum(p * m for p, m in zip(prior, moment, strict=True))
        curvature = sum(prior[i] * gram[i][j] * prior[j] for i in range(n) for j in range(n))
        scale = along / curvature if curvature > 0 and along > 0 else 1.0
        mean = [scale * p for p in prior]
        # In units of the scaled prior (u = coefficient / mean): data D G D, prior weight x identity toward 1.
        weight = self.prior_weight
        g = [[mean[i] * gram[i][j] * mean[j] + (weight if i == j else 0.0) for j in range(n)] for i in range(n)]
        h = [mean[i] * moment[i] + weight for i in range(n)]
        u = _nonnegative_quadratic_min(g, h)
        return StepCost(*(m * ui for m, ui in zip(mean, u, strict=True)))


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """a x = b for a small symmetric positive definite a (Gaussian elimination with partial pivoting)."""
    n = len(b)
    rows = [[*a[i], b[i]] for i in range(n)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
        rows[col], rows[pivot] = rows[pivot], rows[col]
        head = rows[col]
        for r in range(col + 1, n):
            factor = rows[r][col] / head[col]
            if factor:
                row = rows[r]
                for k in range(col, n + 1):
                    row[k] -= factor * head[k]
    x = [0.0] * n
    for i in range(n - 1, -1, -1):
        x[i] = (rows[i][n] - sum(rows[i][k] * x[k] for k in range(i + 1, n))) / rows[i][i]
    return x


def _nonnegative_quadratic_min(g: list[list[float]], h: list[float]) -> list[float]:
    """argmin over x >= 0 of x g x / 2 - h x, for g positive definite (Lawson-Hanson's active set on the normal
    equations). The unconstrained minimum is tried first: with a prior it is almost always the answer."""
    n = len(h)
    free = _solve(g, h)
    if min(free) >= 0:
        return free
    x = [0.0] * n
    passive = [False] * n
    tolerance = 1e-12 * max(1.0, max(abs(v) for v in h))
    for _ in range(3 * n):  # each pass frees one coefficient; a cycle cannot outlast this
        gradient = [h[i] - sum(g[i][j] * x[j] for j in range(n)) for i in range(n)]
        candidates = [i for i in range(n) if not passive[i] and gradient[i] > tolerance]
        if not candidates:
            break
        passive[max(candidates, key=gradient.__getitem__)] = True
        while True:
            support = [i for i in range(n) if passive[i]]
            z = [0.0] * n
            solution = _solve([[g[i][j] for j in support] for i in support], [h[i] for i in support])
            for i, v in zip(support, solution, strict=True):
                z[i] = v
            if all(z[i] > 0 for i in support):
                x = z
                break
            # Step from x toward z until the first coefficient reaches zero, and take it out of the support.
            alpha = min(x[i] / (x[i] - z[i]) for i in support if z[i] <= 0)
            x = [x[i] + alpha * (z[i] - x[i]) for i in range(n)]
            for i in support:
                if x[i] <= tolerance:
                    passive[i] = False
                    x[i] = 0.0
    return x
