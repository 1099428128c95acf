"""The flattened token batch of one engine step, and where each token's KV lives in the paged pool.

Tokens of all scheduled sequences are concatenated: decode tokens first (one per sequence), then each
prefill chunk. Linear layers run on the flat batch; attention is done per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PrefillSlice:
    token_start: int  # offset of this chunk in the flat batch
    num_new: int  # tokens computed in this step
    context_len: int  # tokens with KV after this step (cached prefix + earlier chunks + this chunk)
    block_table: torch.Tensor  # [num_blocks] physical block ids of the sequence (device, long)


@dataclass
class DecodeGroup:
    num_seqs: int  # decode tokens occupy flat positions [0, num_seqs)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] padded with a valid block id (masked out)
    context_lens: torch.Tensor  # [num_seqs] tokens with KV, including this step's token
    max_context_len: int
    paged_kernel: bool = False  # read K/V in place with the Triton kernel instead of gathering for SDPA


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_blocks: torch.Tensor  # [T] physical block that receives each token's KV
    slot_offsets: torch.Tensor  # [T] row inside that block
    decode: DecodeGroup | None
    prefills: list[PrefillSlice]
    logits_indices: torch.Tensor  # [S] flat positions whose logits are sampled

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
