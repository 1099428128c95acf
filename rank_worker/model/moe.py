"""DeepSeek's feed-forward: a gated MLP (the leading dense layers, the shared experts) and the routed MoE with
grouped top-k routing as transformers computes it (deepseek_config.py says which routing each type uses).

Routed experts run as a loop over the experts this batch hit: each takes its tokens, and the weighted
outputs are summed with index_add_ in expert order (transformers' order, so float32 matches it). Finding the
experts hit is a host sync, which a CUDA graph cannot hold: while one is recorded (a decode step of the MLA
kernel backend) every expert runs over every token instead, weighted by its routing weight (0 where it was
not chosen), n_routed_experts / num_experts_per_tok times the routed flops of a step but no sync; its cost
against the eager loop is not measured yet. A fast path would sort tokens by expert and run one grouped GEMM
(a Triton or CUTLASS grouped kernel, or torch._grouped_mm) with no host sync, and with expert parallelism
dispatch tokens across ranks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from rank_worker.model import fused_ops
from rank_worker.model.deepseek_config import DeepseekConfig


def empty_param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
    """Created empty on the current device (no init pass): loaded or filled with random values after."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = empty_param(2 * intermediate, hidden)
        self.down_proj = empty_param(hidden, intermediate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(fused_ops.silu_and_mul_reference(F.linear(x, self.gate_up_proj)), self.down_proj)

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF tensor name -> the part of our parameters it fills."""
        n = self.intermediate
        return {
            f"{prefix}.gate_proj.weight": self.gate_up_proj[:n],
            f"{prefix}.up_proj.weight": self.gate_up_proj[n:],
            f"{prefix}.down_proj.weight": self.down_proj,
        }


class TopkRouter(nn.Module):
    """Picks num_experts_per_tok experts per token and their weights. Kept in float32 whatever the model's
    dtype, as transformers keeps gate.weight (and V3's correction bias): routing must not flip in bf16."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = empty_param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32)
        noaux = cfg.topk_method == "noaux_tc"
        self.e_score_correction_bias = empty_param(cfg.n_routed_experts, dtype=torch.float32) if noaux else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k], float32 weights [T, k])."""
        cfg = self.cfg
        logits = F.linear(x.float(), self.weight)
        scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
        k = cfg.num_experts_per_tok
        if cfg.topk_method == "greedy":
            weights, ids = torch.topk(scores, k=k, dim=-1, sorted=False)
        elif cfg.topk_method == "group_limited_greedy":
            # Groups ranked by their best expert; experts outside the topk_group best groups score 0.
            group_scores = self._grouped(scores).max(dim=-1).values
            weights, ids = torch.topk(
                scores.masked_fill(~self._group_mask(group_scores), 0.0), k=k, dim=-1, sorted=False
            )
        else:  # noaux_tc: the bias steers the choice only; weights are the unbiased scores of the chosen
            assert self.e_score_correction_bias is not None
            choice = scores + self.e_score_correction_bias
            group_scores = self._grouped(choice).topk(2, dim=-1)[0].sum(dim=-1)
            ids = torch.topk(
                choice.masked_fill(~self._group_mask(group_scores), float("-inf")), k=k, dim=-1, sorted=False
            )[1]
            weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor

    def _grouped(self, scores: torch.Tensor) -> torch.Tensor:
        return scores.view(-1, self.cfg.n_group, self.cfg.n_routed_experts // self.cfg.n_group)

    def _group_mask(self, group_scores: torch.Tensor) -> torch.Tensor:
        """[T, n_experts] True for the experts of each token's topk_group best groups."""
        cfg = self.cfg
        best = torch.topk(group_scores, k=cfg.topk_group, dim=-1, sorted=False)[1]
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return (
            mask.unsqueeze(-1)
            .expand(-1, cfg.n_group, cfg.n_routed_experts // cfg.n_group)
            .reshape(-1, cfg.n_routed_experts)
        )


class MoE(nn.Module):
    """Routed experts (stacked: [E, 2I, H] gate/up and [E, H, I] down) plus the always-on shared experts."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        size, experts = cfg.moe_intermediate_size, cfg.n_routed_experts
        self.gate = TopkRouter(cfg)
        self.experts_gate_up = empty_param(experts, 2 * size, cfg.hidden_size)
        self.experts_down = empty_param(experts, cfg.hidden_size, size)
        shared = size * cfg.n_shared_experts
        self.shared_experts = GatedMLP(cfg.hidden_size, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        out = self.every_expert(x, ids, weights) if capturing else self.experts_hit(x, ids, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out

    def experts_hit(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum, each expert over the tokens routed to it."""
        out = torch.zeros_like(x)
        # The experts this batch hit, ascending (one host sync: fine for the CPU path, see the module doc).
        for expert in torch.unique(ids).tolist():
            tokens, slot = torch.where(ids == expert)
            h = F.linear(x[tokens], self.experts_gate_up[expert])
            h = F.linear(fused_ops.silu_and_mul_reference(h), self.experts_down[expert])
            out.index_add_(0, tokens, (h * weights[tokens, slot, None]).to(out.dtype))
        return out

    def every_expert(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The same sum with no host sync: every expert over every token, its output weighted by the token's
        routing weight for it (0 where not chosen), added in expert order as experts_hit adds."""
        out = torch.zeros_like(x)
        routing = torch.zeros(x.shape[0], self.cfg.n_routed_experts, dtype=weights.dtype, device=x.device)
        routing.scatter_(1, ids, weights)  # [T, experts]
        for expert in range(self.cfg.n_routed_experts):
            h = F.linear(x, self.experts_gate_up[expert])
            h = F.linear(fused_ops.silu_and_mul_reference(h), self.experts_down[expert])
            out += (h * routing[:, expert, None]).to(out.dtype)
        return out

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        size = self.cfg.moe_intermediate_size
        targets = {f"{prefix}.gate.weight": self.gate.weight}
        if self.gate.e_score_correction_bias is not None:
            targets[f"{prefix}.gate.e_score_correction_bias"] = self.gate.e_score_correction_bias
        for e in range(self.cfg.n_routed_experts):
            targets[f"{prefix}.experts.{e}.gate_proj.weight"] = self.experts_gate_up[e, :size]
            targets[f"{prefix}.experts.{e}.up_proj.weight"] = self.experts_gate_up[e, size:]
            targets[f"{prefix}.experts.{e}.down_proj.weight"] = self.experts_down[e]
        if self.shared_experts is not None:
            targets.update(self.shared_experts.hf_targets(f"{prefix}.shared_experts"))
        return targets
