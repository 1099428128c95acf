"""The batched sampler against the per-row one it replaced: greedy and seeded rows give exactly its tokens,
unseeded rows its distribution; each row of a mixed batch keeps to its own top-k / top-p; a seeded row's tokens
do not depend on its batch; a bad row fails alone and leaves the others' generators as they were."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings

from rank_worker.engine import sampler
from rank_worker.engine.interface import SamplingParams
from rank_worker.engine.sampler import SamplingError, is_greedy, sample_tokens

_F32 = torch.finfo(torch.float32)


# The per-row sampler as it was before batching (rank_worker/engine/sampler.py at 0e35351), the reference.
def _reference_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    tokens = logits.argmax(dim=-1)
    for row, row_params in enumerate(params):
        if not is_greedy(row_params):
            tokens[row] = _reference_row(logits[row], row_params, generators[row])
    return tokens.tolist()


def _reference_row(row_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = _reference_filtered(row_logits, params)
    uniform = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(uniform.clamp_(_F32.tiny, 1.0 - _F32.eps)))
    return int((scaled + gumbel).argmax())


def _reference_filtered(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scaled = torch.nan_to_num(row_logits.float(), nan=float("-inf"), posinf=_F32.max)
    scaled = (scaled / params.temperature).clamp(min=None, max=_F32.max)
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled


_MIXED = [
    SamplingParams(),
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.7, top_k=5, seed=12),
    SamplingParams(temperature=1.3, top_p=0.8, seed=13),
    SamplingParams(temperature=0.9),
    SamplingParams(temperature=1.0, top_k=20, top_p=0.9, seed=14),
    SamplingParams(temperature=1e-40, top_p=0.5, seed=15),  # greedy by its temperature
    SamplingParams(temperature=2.0, top_k=3),
    SamplingParams(temperature=0.5, top_p=0.95, seed=16),
]


def _generators(params: list[SamplingParams]) -> list[torch.Generator | None]:
    return [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]


def _steps(params: list[SamplingParams], steps: int, vocab: int = 97) -> list[list[int]]:
    """Tokens of `steps` sampling calls on fixed random logits, each row with a fresh generator for its seed."""
    logits = torch.randn((steps, len(params), vocab), generator=torch.Generator().manual_seed(99)) * 3
    generators = _generators(params)
    return [sample_tokens(logits[step], params, generators) for step in range(steps)]


def test_greedy_and_seeded_rows_equal_the_per_row_sampler_exactly() -> None:
    logits = torch.randn((30, len(_MIXED), 97), generator=torch.Generator().manual_seed(99)) * 3
    new_generators, old_generators = _generators(_MIXED), _generators(_MIXED)
    exact = [row for row, p in enumerate(_MIXED) if is_greedy(p) or p.seed is not None]
    for step in range(30):
        new = sample_tokens(logits[step], _MIXED, new_generators)
        old = _reference_tokens(logits[step], _MIXED, old_generators)
        assert [new[row] for row in exact] == [old[row] for row in exact], step


def test_a_greedy_only_batch_is_the_argmax() -> None:
    logits = torch.randn((64, 500), generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(), SamplingParams(temperature=1e-6, seed=1), SamplingParams(top_k=1, temperature=1.0)]
    assert sample_tokens(logits[:3], params, [None] * 3) == logits[:3].argmax(-1).tolist()
    assert sample_tokens(logits, [SamplingParams()] * 64, [None] * 64) == logits.argmax(-1).tolist()


def test_a_seeded_row_draws_the_same_tokens_whatever_else_is_in_the_batch_and_across_runs() -> None:
    seeded = SamplingParams(temperature=1.2, top_k=40, top_p=0.9, seed=7)
    logits = torch.randn((20, 97), generator=torch.Generator().manual_seed(5)) * 3  # the seeded row's, per step

    def tokens_of_the_seeded_row(others: list[SamplingParams]) -> list[int]:
        batch = [*others, seeded]  # every row of the batch gets the seeded row's logits
        generators = _generators(batch)
        return [sample_tokens(logits[step].expand(len(batch), -1), batch, generators)[-1] for step in range(20)]

    alone = tokens_of_the_seeded_row([])
    assert alone == tokens_of_the_seeded_row([])
    for others in (_MIXED, [SamplingParams(temperature=1.0)] * 5, [SamplingParams(temperature=0.8, top_p=0.5)]):
        assert tokens_of_the_seeded_row(others) == alone, others


def test_unseeded_rows_draw_from_the_per_row_samplers_distribution() -> None:
    # One call draws the noise of every unseeded row, so the global generator's stream is split differently
    # from the per-row calls: compare the token frequencies with the filtered softmax, not token by token.
    row = torch.tensor([0.0, 3.0, 2.5, -1.0, 1.0, 2.9, 0.5])
    rows = 20_000
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.6, top_k=3),
        SamplingParams(temperature=1.5, top_p=0.7),
    ):
        torch.manual_seed(0)
        tokens = sample_tokens(row.expand(rows, -1), [params] * rows, [None] * rows)
        expected = _reference_filtered(row, params).softmax(-1)
        counts = torch.bincount(torch.tensor(tokens), minlength=row.numel()).double()
        sigma = (expected.double() * (1 - expected.double()) * rows).sqrt()
        assert torch.all((counts - expected.double() * rows).abs() <= 5 * sigma + 1e-9), (params, counts, expected)


def _nucleus(row_logits: torch.Tensor, params: SamplingParams) -> set[int]:
    """The tokens a row may draw, every token tied with the boundary allowed: the logits scaled in float32 as
    the sampler scales them (which may tie them), the top-p mass in float64 with slack."""
    if is_greedy(params):
        return {t for t, x in enumerate(row_logits.tolist()) if x == row_logits.max()}
    scaled = (row_logits / params.temperature).tolist()
    vocab = len(scaled)
    kept = set(range(vocab))
    if 0 < params.top_k < vocab:
        kth = sorted(scaled, reverse=True)[params.top_k - 1]
        kept = {t for t in kept if scaled[t] >= kth}
    if 0.0 < params.top_p < 1.0:
        top = max(scaled[t] for t in kept)
        weight = {t: math.exp(scaled[t] - top) for t in kept}
        total = sum(weight.values())
        kept = {
            t for t in kept if sum(w for u, w in weight.items() if scaled[u] > scaled[t]) / total < params.top_p + 1e-5
        }
    return kept


_row_params = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 4.0)),
    top_k=st.integers(0, 14),
    top_p=st.one_of(st.just(1.0), st.floats(0.0, 1.0)),
    seed=st.one_of(st.none(), st.integers(0, 2**31)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), vocab=st.integers(2, 12), rows=st.integers(1, 8))
def test_each_row_of_a_mixed_batch_keeps_to_its_own_top_k_and_top_p(data: st.DataObject, vocab: int, rows: int) -> None:
    values = st.one_of(st.sampled_from([-2.0, 0.0, 1.0, 1.5]), st.floats(-6.0, 6.0))  # ties on purpose, too
    logits = data.draw(st.lists(st.lists(values, min_size=vocab, max_size=vocab), min_size=rows, max_size=rows))
    params = data.draw(st.lists(_row_params, min_size=rows, max_size=rows))
    batch = torch.tensor(logits, dtype=torch.float32)
    tokens = sample_tokens(batch, params, _generators(params))
    for row, token in enumerate(tokens):
        assert token in _nucleus(batch[row], params[row]), (row, params[row])


def test_a_bad_row_fails_alone_and_the_others_retry_as_if_it_had_not_been_there() -> None:
    nan_logits = torch.full((97,), float("nan"))
    nan_logits[4] = 1.0
    batch = [
        SamplingParams(temperature=1e-40),  # NaN logits, greedy: an argmax (NaN counts as largest), no failure
        SamplingParams(temperature=1.0, top_p=0.9, seed=21),
        SamplingParams(temperature=float("nan"), seed=22),  # NaN scores: no distribution (validation refuses it)
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.8, top_k=10, seed=23),  # its generator is broken
        SamplingParams(temperature=0.7, top_k=30, seed=24),
    ]
    logits = torch.randn((len(batch), 97), generator=torch.Generator().manual_seed(8)) * 3
    logits[0] = nan_logits
    generators = _generators(batch)
    generators[4] = "not a generator"  # type: ignore[call-overload]
    with pytest.raises(SamplingError) as failed:
        sample_tokens(logits, batch, generators)
    assert failed.value.rows == [2, 4]
    # the step is retried without the failed requests: the seeded rows draw what they would have drawn alone
    keep = [0, 1, 3, 5]
    retried = sample_tokens(logits[keep], [batch[r] for r in keep], [generators[r] for r in keep])
    alone = [sample_tokens(logits[[row]], [batch[row]], _generators([batch[row]]))[0] for row in (1, 5)]
    assert [retried[1], retried[3]] == alone
    assert 0 <= retried[0] < 97


def test_a_temperature_past_float32_is_flat_over_the_allowed_tokens_not_a_failure() -> None:
    logits = torch.tensor([[0.0, 5.0, float("nan"), -3.0]]).expand(400, -1)
    params = [SamplingParams(temperature=1e39)] * 400  # finite, so the engine's validation lets it through
    assert set(sample_tokens(logits, params, [None] * 400)) == {0, 1, 3}  # a NaN logit is -inf, never drawn


def test_a_batch_that_raises_is_sampled_row_by_row_with_the_same_seeded_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    expected = _steps(_MIXED, steps=5)
    batched_filter = sampler._apply_top_k_top_p

    def out_of_memory_for_batches(scaled: torch.Tensor, *args: object) -> None:
        if scaled.shape[0] > 1:  # after the noise was drawn: the generators must be put back for the fallback
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        batched_filter(scaled, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler, "_apply_top_k_top_p", out_of_memory_for_batches)
    fallback = _steps(_MIXED, steps=5)
    seeded = [row for row, p in enumerate(_MIXED) if is_greedy(p) or p.seed is not None]
    assert [[step[r] for r in seeded] for step in fallback] == [[step[r] for r in seeded] for step in expected]
