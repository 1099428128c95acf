"""Sampling: greedy, temperature with a seed, top-k and top-p filtering."""

from __future__ import annotations

import torch

from rank_worker.engine.interface import SamplingParams
from rank_worker.engine.sampler import sample_tokens


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
