"""A MoE layer run across an expert-parallel group: dispatch every rank's tokens to the ranks holding their
experts, and combine the experts' outputs back at each token's own rank.

The simple, correct form: each rank routes its own tokens (the router is whole on every rank), then the group
gathers every rank's tokens, expert ids and weights (all_gather), each rank runs its own experts over the pairs
routed to them (and its shared experts over its own tokens), weighting in float32, and a reduce-scatter sums the
R partial outputs of each token at its owner. Every rank takes part in every call with the same number of rows
(the step's plan, agreed by the lockstep): a rank with fewer tokens pads, an idle one sends padding only.

The sum of a token's output is fixed by the group, not by the batches: its k routed experts and its shared ones
are weighted and summed in float32 on the ranks that hold them, then the R partials summed by the same
reduce-scatter every step, so a token's output does not depend on which other ranks are busy (only on R).

An all-to-all form (send each pair only to the rank of its expert) moves 1/R of the rows; it needs a host sync
for the counts or capacity-padded buffers, and is left until it can be measured on several GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rank_worker.expert_parallel.group import ExpertGroup

if TYPE_CHECKING:
    from rank_worker.model.moe import MoE


@dataclass(frozen=True)
class StepPlan:
    """How the MoE layers of one forward exchange: `calls` exchanges a layer of `rows` rows each, the same on
    every rank of the group (set from the step's agreement; rows = the largest step's tokens, or the MLP's
    chunk where that is smaller)."""

    rows: int
    calls: int = 1

    @classmethod
    def for_tokens(cls, tokens: int, chunk: int) -> StepPlan:
        """The plan for a group whose largest step has `tokens` tokens, its MLPs taking `chunk` rows at a time
        (ForwardBatch.dense_rows; 0: all at once)."""
        tokens = max(tokens, 1)
        rows = min(tokens, chunk) if chunk > 0 else tokens
        return cls(rows, -(-tokens // rows))


class ExpertExchange:
    """Shared by the MoE layers of one rank's model; `plan` is set for each forward by the step's lockstep."""

    def __init__(self, group: ExpertGroup) -> None:
        self.group = group
        self.plan: StepPlan | None = None  # None: every rank runs the same forward (start-up: warm-up, graphs)

    def by_rows(self, moe: MoE, h: torch.Tensor) -> torch.Tensor:
        """The layer over h [T, H]: the plan's calls, each over the next plan.rows rows (or none: padding)."""
        plan = self.plan or StepPlan(max(h.shape[0], 1), 1)
        if h.shape[0] > plan.rows * plan.calls:
            raise RuntimeError(f"a step of {h.shape[0]} tokens past its group plan {plan}: the lockstep is broken")
        if plan.calls == 1:
            return self.run(moe, h, plan.rows)
        out = torch.empty_like(h)
        for call in range(plan.calls):
            start = call * plan.rows
            chunk = h[start : start + plan.rows]
            result = self.run(moe, chunk, plan.rows)
            if chunk.shape[0]:
                out[start : start + chunk.shape[0]] = result
        return out

    def run(self, moe: MoE, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """One exchange: x [t, H] (t <= rows) -> the layer's output for those t tokens."""
        group = self.group
        t, hidden = x.shape
        rows = rows if rows is not None else (self.plan.rows if self.plan is not None else max(t, 1))
        slots = moe.cfg.num_experts_per_tok + moe.shared
        padded = x.new_zeros(rows, hidden)
        ids = torch.zeros(rows, slots, dtype=torch.int64, device=x.device)
        weights = torch.zeros(rows, slots, dtype=torch.float32, device=x.device)
        if t:
            padded[:t] = x
            routed_ids, routed_weights = moe.route(x)
            ids[:t] = routed_ids
            weights[:t] = routed_weights
        tokens = group.all_gather(padded)
        all_ids = group.all_gather(ids)
        all_weights = group.all_gather(weights)
        local_ids, local_weights = self.localize(moe, all_ids, all_weights, rows, tokens)
        partial = moe.experts(tokens, local_ids, local_weights, torch.float32)
        return group.reduce_scatter(partial)[:t].to(x.dtype)

    def localize(
        self, moe: MoE, ids: torch.Tensor, weights: torch.Tensor, rows: int, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The group's slots [R * rows, k + S] in this rank's terms: its routed experts' local rows, its shared
        experts' rows for its own tokens; any other slot weight 0 (and -1 where the expert path skips those,
        else a real row: the shared one of its slot, or the first routed)."""
        n_routed = moe.cfg.n_routed_experts
        first, held = moe.routed.start, len(moe.routed)
        routed_here = (ids >= first) & (ids < first + held)
        shared_slot = ids >= n_routed
        owner = torch.arange(ids.shape[0], device=ids.device) // rows == self.group.rank
        mine = routed_here | (shared_slot & owner.unsqueeze(1))
        local = torch.where(routed_here, ids - first, torch.zeros_like(ids))
        local = torch.where(shared_slot, ids - n_routed + held, local)
        weights = torch.where(mine, weights, torch.zeros_like(weights))
        if moe.serves_masked_slots(tokens):
            local = local.masked_fill(~mine, -1)
        return local, weights
