"""One request as the engine sees it: its tokens, the physical blocks holding their KV, its progress."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rank_worker.engine.interface import FinishReason, SamplingParams

if TYPE_CHECKING:
    from rank_worker.l1.host_fetch import HostFetch


# Stands in token_ids for a token drawn by a step still running on the device, while its successor is
# scheduled (paged_engine.py, pipeline_steps): counted like any token, replaced once the step is read.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_L1 = "waiting_for_l1"  # in the waiting queue, its blocks coming from the host tier
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt, then outputs as they are sampled
    num_prompt_tokens: int
    sampling: SamplingParams
    arrival_time: float
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of the full blocks computed so far
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_l0_cached_tokens: int | None = None  # L0 prefix hit at first scheduling (None until scheduled)
    num_l1_cached_tokens: int = 0  # restored from the L1 host cache at first scheduling
    first_scheduled_time: float | None = None
    last_scheduled_time: float | None = None  # when a step last gave it tokens (the scheduler's clock)
    first_token_time: float | None = None
    finish_time: float | None = None
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    preemptions: int = 0
    generator: torch.Generator | None = None
    # The chain of hashes over the full blocks of token_ids, as far as known: computed once (or sent with the
    # request), only extended. The cache lookup keys are its first (num_tokens - 1) // block_size (KvCacheManager).
    lookup_hashes: list[bytes] = field(default_factory=list)
    cold_until: int = 0  # a cold prefill (warm_first) while num_computed_tokens < this; set on each admission
    starved: bool = False  # warm_first: went cold_max_wait_secs without a token (scheduler.py); sticky
    host_fetch: HostFetch | None = None  # its restore from the host tier while WAITING_FOR_L1 (KvCacheManager)
    # blocks the host tier held past its L0 prefix at its last admission try that no restore was started for, the
    # free pool having no room for any of them (computed instead): counted by the scheduler once it is admitted
    l1_unstarted_blocks: int = 0
    l1_lookups_cut: int = 0  # its host-tier lookups answered with no room for any block (looked up again)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still to run through the model (the whole prompt at first, then 1 per decode step)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
