"""The step-cost model alone: it recovers a linear cost from measured steps, from the first step on and with
noise, stalls, a prior orders of magnitude off, or inputs that never vary; the chunk it allows fits the budget."""

from __future__ import annotations

import math
import random
from dataclasses import astuple

import pytest

from rank_worker.engine.step_cost import PRIOR, StepCost, StepCostModel, StepLoad, _nonnegative_quadratic_min

# A machine unlike the prior's: other proportions between the terms, every term slower or faster.
TRUE = StepCost(
    step_s=3e-3,
    prefill_step_s=1e-3,
    decode_row_s=1e-5,
    decode_kv_token_s=2e-8,
    prefill_token_s=1e-5,
    prefill_attention_s=5e-10,
)


def _random_load(rng: random.Random) -> StepLoad:
    """What serving steps carry: up to 64 decoding rows at 100 to 20K context, sometimes a chunk."""
    load = StepLoad()
    for _ in range(rng.randint(0, 64)):
        load = load.with_decode(rng.randint(100, 20_000))
    if rng.random() < 0.4 or load.decode_rows == 0:
        load = load.with_chunk(rng.randint(16, 4096), rng.randint(0, 30_000))
    return load


def _relative_errors(model: StepCostModel, truth: StepCost, rng: random.Random, n: int = 200) -> list[float]:
    loads = [_random_load(rng) for _ in range(n)]
    return [abs(model.predict(load) / truth.seconds(load) - 1) for load in loads]


def test_it_predicts_from_the_prior_before_any_step() -> None:
    model = StepCostModel()
    assert model.coefficients() == PRIOR
    decodes = StepLoad(decode_rows=64, decode_kv_tokens=64 * 4096)
    assert 0.015 <= model.predict(decodes) <= 0.025  # the H200's 64 decodes at 4K: ~21 ms
    assert 0.1 <= model.predict(StepLoad().with_chunk(4096, 0)) <= 0.2  # a 4K chunk: ~0.13-0.16 s


def test_it_fits_a_synthetic_linear_cost() -> None:
    rng = random.Random(1)
    model = StepCostModel()
    for _ in range(400):
        load = _random_load(rng)
        model.observe(load, TRUE.seconds(load))
    errors = _relative_errors(model, TRUE, random.Random(2))
    assert max(errors) < 0.05 and sum(errors) / len(errors) < 0.01
    fitted = model.coefficients()
    # The terms that carry the time come back; minor ones may trade a little against correlated ones.
    assert fitted.prefill_token_s == pytest.approx(TRUE.prefill_token_s, rel=0.02)
    assert fitted.prefill_attention_s == pytest.approx(TRUE.prefill_attention_s, rel=0.05)
    assert fitted.decode_kv_token_s == pytest.approx(TRUE.decode_kv_token_s, rel=0.1)
    assert fitted.step_s == pytest.approx(TRUE.step_s, rel=0.1)


def test_noise_leaves_it_sane_and_its_coefficients_non_negative() -> None:
    rng = random.Random(3)
    model = StepCostModel()
    for _ in range(600):
        load = _random_load(rng)
        model.observe(load, TRUE.seconds(load) * math.exp(rng.gauss(0.0, 0.15)))  # ~15% jitter
    errors = _relative_errors(model, TRUE, random.Random(4))
    assert sum(errors) / len(errors) < 0.08 and max(errors) < 0.3
    assert all(c >= 0 and math.isfinite(c) for c in astuple(model.coefficients()))


def test_one_step_rescales_a_prior_that_is_orders_of_magnitude_off() -> None:
    # A CPU running a tiny model: everything 100 times cheaper than on the H200 in the prior's proportions.
    cheap = StepCost(*(c / 100 for c in astuple(PRIOR)))
    model = StepCostModel()
    decodes = StepLoad(decode_rows=8, decode_kv_tokens=8 * 500)
    model.observe(decodes, cheap.seconds(decodes))
    assert model.predict(decodes) == pytest.approx(cheap.seconds(decodes), rel=0.01)
    chunk = StepLoad().with_chunk(2048, 1000)
    assert model.predict(chunk) == pytest.approx(cheap.seconds(chunk), rel=0.05), "scaled, in the prior's proportions"
    # And other proportions than the prior's take over within tens of steps.
    rng = random.Random(5)
    slow = StepCost(*(c * 30 for c in astuple(TRUE)))
    model = StepCostModel()
    for _ in range(40):
        load = _random_load(rng)
        model.observe(load, slow.seconds(load))
    errors = _relative_errors(model, slow, random.Random(6))
    assert sum(errors) / len(errors) < 0.05


def test_inputs_that_never_vary_pin_what_they_measure_and_leave_the_rest_to_the_prior() -> None:
    model = StepCostModel()
    decodes = StepLoad(decode_rows=32, decode_kv_tokens=32 * 2000)
    for _ in range(500):
        model.observe(decodes, TRUE.seconds(decodes))
    assert model.predict(decodes) == pytest.approx(TRUE.seconds(decodes), rel=1e-3)
    fitted = model.coefficients()
    assert all(c > 0 and math.isfinite(c) for c in astuple(fitted))
    # Prefill was never seen: its terms keep the prior's ratio, scaled as the decodes scaled the rest.
    assert fitted.prefill_token_s / fitted.prefill_attention_s == pytest.approx(
        PRIOR.prefill_token_s / PRIOR.prefill_attention_s, rel=0.01
    )
    assert 0 < model.max_chunk_tokens(decodes, 0, 0.05) < 10_000


def test_stalls_barely_move_it() -> None:
    rng = random.Random(7)
    model = StepCostModel()
    for step in range(300):
        load = _random_load(rng)
        stalled = step % 50 == 0  # a JIT compile or a GC pause: 30 times the work's time
        model.observe(load, TRUE.seconds(load) * (30 if stalled else 1))
    errors = _relative_errors(model, TRUE, random.Random(8))
    assert sum(errors) / len(errors) < 0.05


def test_it_follows_a_machine_that_changes() -> None:
    rng = random.Random(9)
    model = StepCostModel()
    for _ in range(300):
        load = _random_load(rng)
        model.observe(load, TRUE.seconds(load))
    slower = StepCost(*(c * 2 for c in astuple(TRUE)))
    for _ in range(1000):  # five half-lives
        load = _random_load(rng)
        model.observe(load, slower.seconds(load))
    errors = _relative_errors(model, slower, random.Random(10))
    assert sum(errors) / len(errors) < 0.05


def test_a_step_that_took_no_time_is_ignored() -> None:
    model = StepCostModel()
    for seconds in (0.0, -1.0, math.nan, math.inf):
        model.observe(StepLoad(decode_rows=1, decode_kv_tokens=10), seconds)
    assert model.steps == 0 and model.coefficients() == PRIOR


def test_the_chunk_it_allows_is_the_largest_that_fits_the_budget() -> None:
    model = StepCostModel(prior=TRUE)
    decodes = StepLoad(decode_rows=48, decode_kv_tokens=48 * 8000)
    for cached in (0, 10_000, 100_000):
        n = model.max_chunk_tokens(decodes, cached, 0.05)
        assert n > 0
        assert model.predict(decodes.with_chunk(n, cached)) <= 0.05 + 1e-12
        assert model.predict(decodes.with_chunk(n + 1, cached)) > 0.05
    assert model.max_chunk_tokens(decodes, 0, 0.05) > model.max_chunk_tokens(decodes, 100_000, 0.05)
    assert model.max_chunk_tokens(decodes, 0, model.predict(decodes)) == 0, "no time left: no chunk"
    with_chunk = decodes.with_chunk(512, 0)  # a second chunk pays no second prefill-step overhead
    n = model.max_chunk_tokens(with_chunk, 0, 0.05)
    assert model.predict(with_chunk.with_chunk(n, 0)) <= 0.05 + 1e-12 < model.predict(with_chunk.with_chunk(n + 1, 0))


def test_the_non_negative_solve_clamps_what_would_go_negative() -> None:
    # Unconstrained: x = g^-1 h = (2, -1); with x >= 0 the minimum is x = (h0 / g00, 0) = (1.5, 0).
    g = [[2.0, 1.0], [1.0, 1.0]]
    h = [3.0, 1.0]
    x = _nonnegative_quadratic_min(g, h)
    assert x == pytest.approx([1.5, 0.0])
    assert _nonnegative_quadratic_min([[1.0, 0.0], [0.0, 1.0]], [2.0, 3.0]) == pytest.approx([2.0, 3.0])
