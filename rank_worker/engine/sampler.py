"""Turning the last position's logits into the next token: greedy, or temperature / top-k / top-p sampling.

Sampling is Gumbel-max on float32 logits, so no temperature the API accepts
can overflow it: temperatures below MIN_TEMPERATURE are greedy, non-finite logits are clamped, and nothing is
ever drawn from a distribution that does not sum to one (torch.multinomial raised on those). A row that still
fails is named in SamplingError, so the caller fails that sequence alone.
"""

from __future__ import annotations

import torch

from rank_worker.engine.interface import SamplingParams

# Below this a temperature makes every logit gap of 1e-3 or more a certainty: greedy, without the division
# (logits / 1e-40 overflows float32; the API accepts such values).
MIN_TEMPERATURE = 1e-5
_FLOAT32_MAX = torch.finfo(torch.float32).max
_FLOAT32_TINY = torch.finfo(torch.float32).tiny
_FLOAT32_EPS = torch.finfo(torch.float32).eps


class SamplingError(RuntimeError):
    """Sampling failed for some rows of the batch (indices into the logits); the other rows were fine."""

    def __init__(self, rows: list[int], cause: BaseException) -> None:
        super().__init__(f"sampling failed for row(s) {rows}: {cause!r}")
        self.rows = rows
        self.cause = cause


def is_greedy(params: SamplingParams) -> bool:
    return params.greedy or params.temperature < MIN_TEMPERATURE or params.top_k == 1


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: [S, vocab], one row per sequence. Rows with a seed draw from their own generator.

    Raises SamplingError naming the rows that could not be sampled (each row is sampled on its own)."""
    tokens = logits.argmax(dim=-1)
    failed: list[int] = []
    cause: BaseException | None = None
    for row, row_params in enumerate(params):
        if is_greedy(row_params):
            continue
        try:
            tokens[row] = _sample_row(logits[row], row_params, generators[row])
        except Exception as exc:  # one sequence's parameters or logits must not fail the whole batch
            failed.append(row)
            cause = cause or exc
    if cause is not None:
        raise SamplingError(failed, cause)
    return tokens.tolist()


def _sample_row(row_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = _filtered_logits(row_logits, params)
    # Gumbel-max: argmax(logit + Gumbel noise) draws from softmax(logits) without forming the probabilities.
    # The uniform draw is kept off 0 and 1 so the noise is finite and a filtered (-inf) token never wins.
    uniform = torch.rand(scaled.shape, generator=generator, device=scaled.device, dtype=torch.float32)
    gumbel = -torch.log(-torch.log(uniform.clamp_(_FLOAT32_TINY, 1.0 - _FLOAT32_EPS)))
    return int((scaled + gumbel).argmax())


def _filtered_logits(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scaled = torch.nan_to_num(row_logits.float(), nan=float("-inf"), posinf=_FLOAT32_MAX)
    scaled = (scaled / params.temperature).clamp(min=None, max=_FLOAT32_MAX)
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token once the ones before it already reach top_p (the first token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled
