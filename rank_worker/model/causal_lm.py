"""What the engine asks of a model, whichever family it is (llama.py, deepseek.py)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from rank_worker.model.attention.backend import AttentionBackend, BackendName
from rank_worker.model.forward_batch import ForwardBatch


class CausalLM(Protocol):
    cfg: Any  # LlamaFamilyConfig or DeepseekConfig: vocab_size, num_layers, hidden_size, ...
    embed_tokens: torch.Tensor  # its device and dtype are the model's

    def __call__(self, batch: ForwardBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """float32 logits [len(batch.logits_indices), vocab] of one step over the paged pool."""
        ...

    def kv_block_shape(self, block_size: int) -> tuple[int, ...]:
        """One block of the paged pool (the pool is [num_blocks, *this]): all layers of block_size tokens."""
        ...

    def choose_attention(
        self, setting: BackendName, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype | None = None
    ) -> AttentionBackend:
        """The attention backend this model runs under the attention_backend setting, over a pool of kv_dtype
        (None: dtype)."""
        ...

    def set_attention_backend(self, backend: AttentionBackend) -> None: ...

    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def init_random_weights(self, seed: int = 0, scheme: str = "normal") -> None: ...

    def eval(self) -> CausalLM: ...
