"""The decoder stack run with each residual add folded into the norm after it (fused_ops.add_rms_norm: one
kernel reads x and the stream, writes the stream and the normed sum), for every family whose layers are
pre-norm as Llama's: x + attn(norm(x)), then + mlp(norm(.)). Two fewer passes over the hidden state a layer
than the eager adds, and the same bits (the kernel rounds the sum where the eager add does)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from rank_worker.model.forward_batch import ForwardBatch


class _Norm(Protocol):
    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor: ...


class PreNormLayer(Protocol):
    input_layernorm: _Norm
    post_attention_layernorm: _Norm

    def self_attn(self, x: torch.Tensor, kv_layer: torch.Tensor, batch: ForwardBatch) -> torch.Tensor: ...

    def mlp(self, x: torch.Tensor) -> torch.Tensor: ...


def run_fused(
    layers: Iterable[PreNormLayer], x: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, final_norm: _Norm
) -> torch.Tensor:
    """The final norm of the stream at the logits rows (batch.logits_indices); kv_cache [blocks, layers, ...].
    x (the embeddings) becomes the residual stream and is updated in place."""
    residual: torch.Tensor | None = None
    for index, layer in enumerate(layers):
        if residual is None:
            residual = x  # the first layer: the stream is the embedding
            h = layer.input_layernorm.add_and_norm(x, None)
        else:
            h = layer.input_layernorm.add_and_norm(x, residual)
        h = layer.post_attention_layernorm.add_and_norm(layer.self_attn(h, kv_cache[:, index], batch), residual)
        x = mlp_by_rows(layer.mlp, h, batch.dense_rows)
    assert residual is not None
    rows = batch.logits_indices
    return final_norm.add_and_norm(x[rows], residual[rows])


def mlp_by_rows(mlp: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, rows: int) -> torch.Tensor:
    """mlp(h) (a row-wise map of the hidden state onto itself), `rows` rows at a time where h has more (0: all
    at once): what a step longer than max_num_batched_tokens (a solo prefill) keeps its activation peak under.
    Every row is computed on its own either way; a GEMM may round differently by its row count (its kernel is
    chosen by shape), as between any two chunkings of a prompt."""
    by_rows = getattr(mlp, "by_rows", None)  # a MoE layer: across an expert-parallel group its exchange chunks
    if by_rows is not None:
        return by_rows(h, rows)
    return mlp_rows(mlp, h, rows)


def mlp_rows(mlp: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor, rows: int) -> torch.Tensor:
    """mlp_by_rows on one rank."""
    if rows <= 0 or h.shape[0] <= rows:
        return mlp(h)
    out = torch.empty_like(h)
    for start in range(0, h.shape[0], rows):
        out[start : start + rows] = mlp(h[start : start + rows])
    return out
