"""Sampling: greedy, temperature with a seed, top-k and top-p filtering; numerically safe for any accepted
temperature and for non-finite logits; a failing row is named, not the whole batch."""

from __future__ import annotations

import pytest
import torch

from rank_worker.engine.interface import SamplingParams
from rank_worker.engine.sampler import SamplingError, sample_tokens


def _logits() -> torch.Tensor:
    return torch.tensor([[0.0, 3.0, 2.5, -1.0, 1.0], [5.0, 0.0, 0.0, 0.0, 4.9]])


def _draws(params: SamplingParams, seed: int, count: int = 200) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [sample_tokens(_logits()[:1], [params], [gen])[0] for _ in range(count)]


def test_greedy_takes_the_argmax_per_row() -> None:
    assert sample_tokens(_logits(), [SamplingParams(), SamplingParams()], [None, None]) == [1, 0]


def test_same_seed_same_tokens_and_temperature_spreads_choices() -> None:
    params = SamplingParams(temperature=1.0)
    assert _draws(params, seed=5) == _draws(params, seed=5)
    assert _draws(params, seed=5) != _draws(params, seed=6)
    assert len(set(_draws(params, seed=5))) >= 4  # a flat-ish distribution visits most tokens


def test_top_k_and_top_p_restrict_the_candidates() -> None:
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2), seed=1)) == {1, 2}
    # p(1) ~ 0.50, p(2) ~ 0.30: top_p 0.6 keeps exactly those two
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.6), seed=2)) == {1, 2}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.1), seed=3)) == {1}
    assert set(_draws(SamplingParams(temperature=1.0, top_k=1), seed=4)) == {1}


def test_low_temperature_concentrates_on_the_best_token() -> None:
    draws = _draws(SamplingParams(temperature=0.05), seed=7)
    assert draws.count(1) >= 195


def test_tiny_temperatures_are_greedy_and_never_overflow() -> None:
    # logits / 1e-40 overflows float32: the sampler raised, and the engine failed every request of the step
    for temperature in (1e-45, 1e-40, 1e-38, 1e-30, 5e-6):
        params = SamplingParams(temperature=temperature, top_p=0.9, top_k=3)
        gen = torch.Generator().manual_seed(1)
        assert sample_tokens(_logits(), [params, params], [gen, None]) == [1, 0], temperature


def test_extreme_and_non_finite_logits_sample_an_allowed_token() -> None:
    logits = torch.tensor([[1e30, -1e30, float("inf"), float("nan"), 0.0], [float("nan")] * 5])
    params = SamplingParams(temperature=0.7, top_k=2)
    for seed in range(50):
        tokens = sample_tokens(logits, [params, params], [torch.Generator().manual_seed(seed), None])
        assert tokens[0] in (0, 2) and 0 <= tokens[1] < 5


def test_a_row_that_fails_is_named_and_the_others_are_not() -> None:
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), SamplingParams()]
    bogus = "not a generator"  # the one row's sampling state is broken
    with pytest.raises(SamplingError) as failed:
        sample_tokens(_logits()[[0, 1, 0]], params, [None, bogus, None])  # type: ignore[list-item]
    assert failed.value.rows == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_mixed_batch_draws_what_each_row_asks_for() -> None:
    """The settings go to the device without waiting for the forward (pinned, non-blocking): behind a queued
    matmul, greedy rows still take the argmax, filters still hold and seeded rows repeat their draws."""
    device = torch.device("cuda")
    logits = torch.randn(64, 32_000, device=device) * 3
    params = [
        SamplingParams()
        if i % 4 == 0
        else SamplingParams(
            temperature=1.0,
            top_k=3 if i % 4 == 1 else 0,
            top_p=0.5 if i % 4 == 2 else 1.0,
            seed=i if i % 4 == 3 else None,
        )
        for i in range(64)
    ]

    def draw() -> list[int]:
        generators = [
            torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None else None for p in params
        ]
        busy = torch.randn(4096, 4096, device=device)
        for _ in range(8):
            busy = busy @ busy  # queued work the sampling launch must not wait for
        return sample_tokens(logits, params, generators)

    first, second = draw(), draw()
    top3 = logits.topk(3, dim=-1).indices.tolist()
    argmax = logits.argmax(dim=-1).tolist()
    for i in range(len(params)):
        if i % 4 == 0:
            assert first[i] == argmax[i]
        elif i % 4 == 1:
            assert first[i] in top3[i]
        elif i % 4 == 3:
            assert first[i] == second[i]  # its own generator, whatever else is in the batch
        assert 0 <= first[i] < 32_000
