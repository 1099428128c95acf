"""The step-time model: it reproduces the H200 measurements it was fitted to (the engine benchmark alone, and
with the decode probe: contexts, padding, mixed steps it was not fitted to), its formulas add up (chunks,
floor, mixed steps), and a fit recovers the coefficients of data made from a known model."""

from __future__ import annotations

import pytest
from sim_workloads import DECODE_PROBE, ENGINE_RESULTS, ROOT, h200_step_time

from simulator.step_time import StepTimeModel, fit_report, fit_step_time, load_engine_results


def test_the_engine_benchmark_alone_is_fitted_within_five_percent() -> None:
    results = load_engine_results(ENGINE_RESULTS)
    model = fit_step_time(results)
    rows = fit_report(model, results)
    assert len(rows) == 3 + 4 + 4  # prefill 2K/8K/32K, TTFT cold and warm at 32K/100K, decode at 4 batches
    for row in rows:
        assert row["model_s"] == pytest.approx(row["measured_s"], rel=0.05), row
    assert all(value >= 0 for value in (model.overhead_s, model.alpha_s, model.beta_s, model.gamma_s))
    assert model.decode_pad_token_s == model.decode_kv_token_s  # no padding measured: costed as real KV


def test_with_the_decode_probe_every_point_is_within_fifteen_percent() -> None:
    results, probe = load_engine_results(ENGINE_RESULTS), load_engine_results(DECODE_PROBE)
    model = fit_step_time(results, probe)
    rows = fit_report(model, results, probe)
    kinds = [row["kind"] for row in rows]
    assert kinds.count("prefill") == 9 and kinds.count("decode") == 18 and kinds.count("mixed") == 2
    errors = sorted(abs(row["model_s"] / row["measured_s"] - 1) for row in rows)
    # The worst: one long row among short ones, whose empty split-K slices the padding term only approximates.
    assert errors[-1] < 0.2
    assert errors[len(errors) // 2] < 0.05
    # Mixed steps were not fitted: a prefill chunk plus 16 decodes adds up from the two parts.
    for row in rows:
        if row["kind"] == "mixed":
            assert row["model_s"] == pytest.approx(row["measured_s"], rel=0.1)
    # Padding (one long context among short ones) costs, but less than real KV.
    assert 0 < model.decode_pad_token_s < model.decode_kv_token_s


def test_prefill_is_chunked_one_step_per_chunk() -> None:
    model = h200_step_time()
    chunk = model.max_num_batched_tokens
    whole = model.prefill_s(2 * chunk + 100)
    parts = model.overhead_s * 3 + model.chunk_s(chunk, 0) + model.chunk_s(chunk, chunk) + model.chunk_s(100, 2 * chunk)
    assert whole == pytest.approx(parts)
    # A warm turn (1K new over 100K cached) costs a fraction of the cold prefill of the same prompt.
    assert model.prefill_s(1024, cached=100_000) < model.prefill_s(101_024) / 20


def test_decode_is_launch_bound_then_grows_with_the_kv_it_reads() -> None:
    model = h200_step_time()
    assert model.decode_step_s(1, 4096) == model.decode_floor_s  # replayed from a graph: ~8 ms of launches
    assert model.decode_floor_s < model.decode_step_s(8, 4096) < 1.2 * model.decode_floor_s
    assert model.decode_step_s(64, 4096) < model.decode_step_s(128, 4096) < model.decode_step_s(128, 8192)
    assert model.decode_step_s(0, 4096) == 0.0
    # The same KV costs the same however it is split; rows shorter than the longest cost a little extra.
    assert model.decode_step_s(128, 4096) == pytest.approx(model.decode_step_s(4, 131072))
    uniform = model.decode_step_s(16, 8192)
    one_long = model.decode_step_s(16, 65536, kv_tokens=65536 + 15 * 4096)
    assert one_long > uniform
    assert one_long == pytest.approx(
        model.decode_base_s + model.decode_kv_token_s * (65536 + 15 * 4096) + model.decode_pad_token_s * 15 * 61440
    )


def test_a_mixed_step_pays_the_prefill_and_the_kv_its_decodes_read() -> None:
    model = h200_step_time()
    alone = model.step_s([(2048, 0)], [])
    mixed = model.step_s([(2048, 0)], [4096] * 32)
    assert mixed == pytest.approx(alone + model.decode_kv_token_s * 32 * 4096)
    assert model.step_s([(2048, 0)], [8192, 4096]) == pytest.approx(alone + model.decode_kv_s(2, 8192, 12288))
    assert model.step_s([], [4096] * 16) == model.decode_step_s(16, 4096)


def test_the_fit_recovers_a_known_model() -> None:
    truth = StepTimeModel(0.01, 3e-5, 1e-9, 2e-9, 0.03, -0.002, 2e-7, 2e-7, 32768, prefix_token_s=3e-7)
    results = {
        "settings": {"max_num_batched_tokens": 32768},
        "prefill": [{"tokens": n, "seconds": truth.prefill_s(n)} for n in (2048, 8192, 32768)],
        "ttft": [
            {
                "context": c,
                "new_tokens": 1024,
                "cold_s": truth.prefill_s(c + 1024),
                "warm_s": truth.prefill_s(1024, c),
                "warm_cached_tokens": c,
            }
            for c in (32768, 100_000)
        ],
        "decode": [
            {"batch": b, "context": 4096, "step_ms": truth.decode_step_s(b, 4096) * 1e3} for b in (1, 16, 64, 128)
        ],
    }
    fitted = fit_step_time(results)
    names = ("overhead_s", "alpha_s", "beta_s", "gamma_s", "prefix_token_s", "decode_floor_s", "decode_base_s")
    for name in (*names, "decode_kv_token_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name


def test_mla_prefill_pays_for_its_cached_prefix_once_a_chunk() -> None:
    # DeepSeek-V2-Lite on the H200: a chunk expands its whole prefix's latents into per-head K/V, so 1K new
    # tokens over 100K cached cost more than gamma alone explains; the per-chunk prefix term takes it.
    results = load_engine_results(ROOT / "simulator" / "results" / "engine-dsv2-lite-h200.json")
    model = fit_step_time(results)
    rows = [row for row in fit_report(model, results) if row["kind"] == "prefill"]
    assert len(rows) == 3 + 4 + 2  # the warm 8K over 32K and 4K over 100K measures count too
    for row in rows:
        assert row["model_s"] == pytest.approx(row["measured_s"], rel=0.1), row
    assert model.prefix_token_s > 1e-7  # 0.3 us: 120 ms a chunk over 400K cached tokens
    assert model.chunk_s(1024, 400_000) > model.chunk_s(1024, 0) + 400_000 * model.prefix_token_s
