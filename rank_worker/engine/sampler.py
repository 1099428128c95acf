"""Turning the last position's logits into the next token: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

import torch

from rank_worker.engine.interface import SamplingParams


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> list[int]:
    """logits: float32 [S, vocab], one row per sequence. Rows with a seed draw from their own generator."""
    tokens = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    for row in sampled_rows:
        probs = _filtered_probs(logits[row], params[row])
        tokens[row] = torch.multinomial(probs, 1, generator=generators[row])[0]
    return tokens.tolist()


def _filtered_probs(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    scaled = row_logits / params.temperature
    if params.top_k > 0 and params.top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if 0.0 < params.top_p < 1.0:
        sorted_logits, order = scaled.sort(descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # drop a token once the ones before it already reach top_p (the first token always stays)
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= params.top_p
        scaled = scaled.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return scaled.softmax(-1)
