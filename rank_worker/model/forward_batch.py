"""The flattened token batch of one engine step, and where each token's KV lives in the paged pool.

Tokens of all scheduled sequences are concatenated: decode tokens first (one per sequence), then each
prefill chunk. Linear layers run on the flat batch; attention runs per group through the step's
attention backend, which reads the blocks through `block_tables` (the model runner's persistent table:
one row per running sequence, updated in place as sequences grow).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PrefillSlice:
    token_start: int  # offset of this chunk in the flat batch
    num_new: int  # tokens computed in this step
    context_len: int  # tokens with KV after this step (cached prefix + earlier chunks + this chunk)
    table_row: int  # the sequence's row of block_tables


def require_adjacent(pieces: list[PrefillSlice], backend: str) -> None:
    """Chunks (in token order) that one kernel launch reads as one contiguous range of q rows must follow each
    other in the batch; a batch built otherwise is a bug, said by the backend's name."""
    for before, after in itertools.pairwise(pieces):
        if before.token_start + before.num_new != after.token_start:
            raise RuntimeError(f"{backend}: prefill chunks of a step must be adjacent in the batch")


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_blocks: torch.Tensor  # [T] physical block that receives each token's KV
    slot_offsets: torch.Tensor  # [T] row inside that block
    logits_indices: torch.Tensor  # [S] flat positions whose logits are sampled
    block_tables: torch.Tensor  # [rows, max_blocks] int32: each row a sequence's physical blocks in order
    num_decodes: int = 0  # decode tokens occupy flat positions [0, num_decodes)
    decode_rows: torch.Tensor | None = None  # [num_decodes] block_tables row of each decode sequence
    decode_lens: torch.Tensor | None = None  # [num_decodes] tokens with KV, including this step's token
    prefills: list[PrefillSlice] = field(default_factory=list)
    attention: object = None  # the attention backend's per-step metadata (AttentionBackend.plan)
    # The most rows an MLP runs at once (0: all): a solo prefill's step is longer than max_num_batched_tokens, and
    # its MLP activations (7x the hidden state in the llama-8b shape) would set the activation peak the KV pool
    # is sized after; attention needs the whole step at once, the MLP (row by row) does not.
    dense_rows: int = 0

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
