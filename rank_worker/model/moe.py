"""DeepSeek's feed-forward: a gated MLP (the leading dense layers) and the MoE with grouped top-k routing as
transformers computes it (deepseek_config.py says which routing each type uses).

The shared experts run as experts too: stacked after the routed ones (their MLP of n_shared x
moe_intermediate_size is n_shared experts of moe_intermediate_size side by side, each a slice of the
intermediate dims), every token routed to them at weight 1 in slots after its k routed ones. A decode step then
reads their weights in the same two expert kernels, and sums their outputs with the routed ones in one float32
combine, instead of three GEMM launches, a SiLU and an add of their own a layer (SGLang fuses them the same way).

Experts run one of three ways, all giving each token the weighted sum of its experts:
- grouped (bf16 on a CUDA GPU of compute capability 9.0 or later, eager and inside a recorded decode graph):
  the (token, expert) pairs sorted by expert and run as two grouped GEMMs (torch._grouped_mm: gate/up, then
  down, each expert over its contiguous run of rows), the offsets of the runs counted on the device: no host
  sync, so it is graph-safe. Each token's k + S outputs are put back in slot order and summed in float32 (no
  atomics: the same inputs give the same bits, which the warm-vs-cold match needs). Decode-sized batches
  sort by moe_kernels.align instead of ~7 small PyTorch ops and run the experts by moe_mlp_kernel's two
  kernels instead of the grouped GEMMs; every batch on CUDA sums by moe_kernels.combine. Their greedy routing
  is one moe_kernels.route launch (the other routing methods, prefill and the CPU keep PyTorch's).
- experts_hit (the CPU and float32 path): a loop over the experts this batch hit, each over its tokens, the
  weighted outputs summed with index_add_ in expert order (transformers' order, so float32 matches it).
  Finding the experts hit is a host sync.
- every_expert (a recorded graph where grouped GEMMs do not run): every expert over every token, weighted by
  its routing weight (0 where not chosen): n_routed_experts / num_experts_per_tok times the routed flops.
With expert parallelism (rank_worker/expert_parallel/) a rank holds only its shard of the routed experts
(stacked first, then the shared ones whole) and its `exchange` runs the layer across the group: every rank's
tokens and routing gathered, each rank's experts over the pairs routed to them, the sums sent back.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from rank_worker.expert_parallel.shard import WHOLE, ExpertShard
from rank_worker.model import fused_ops, moe_kernels, moe_mlp_kernel
from rank_worker.model.deepseek_config import DeepseekConfig
from rank_worker.model.residual_stream import mlp_rows as residual_stream_rows


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
        self.fused = False  # SiLU x up by one kernel (CUDA: the model sets it with its kernel backend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(x, self.gate_up_proj)
        act = fused_ops.silu_and_mul(gate_up) if self.fused else fused_ops.silu_and_mul_reference(gate_up)
        return F.linear(act, self.down_proj)

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor]:
        """HF tensor name -> the part of our parameters it fills."""
        n = self.intermediate
        return {
            f"{prefix}.gate_proj.weight": self.gate_up_proj[:n],
            f"{prefix}.up_proj.weight": self.gate_up_proj[n:],
            f"{prefix}.down_proj.weight": self.down_proj,
        }


def grouped_gemm_runs(x: torch.Tensor) -> bool:
    """Whether torch._grouped_mm serves this input: bf16 on a CUDA GPU of compute capability >= 9.0 (its
    CUTLASS kernels; float32 and older GPUs take the other paths)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and hasattr(torch, "_grouped_mm")
        and _capability(x.device.index if x.device.index is not None else torch.cuda.current_device()) >= (9, 0)
    )


def route_runs(x: torch.Tensor) -> bool:
    """Whether moe_kernels.route routes this batch: decode-sized, on CUDA, with Triton."""
    return x.is_cuda and moe_kernels.triton is not None and x.shape[0] <= moe_kernels.ROUTE_MAX_TOKENS


@functools.cache
def _capability(device: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return fused_ops.silu_and_mul(gate_up) if gate_up.is_cuda else fused_ops.silu_and_mul_reference(gate_up)


@dataclass(frozen=True)
class Rearranged:
    """A checkpoint tensor of shape `shape` that fills `into` once rearranged by `arrange` (the loader checks the
    checkpoint's shape against `shape`, then copies arrange(tensor) into `into`)."""

    into: torch.Tensor
    shape: tuple[int, ...]
    arrange: Callable[[torch.Tensor], torch.Tensor]


class TopkRouter(nn.Module):
    """Picks num_experts_per_tok experts per token and their weights. Kept in float32 whatever the model's
    dtype, as transformers keeps gate.weight (and V3's correction bias): routing must not flip in bf16."""

    def __init__(self, cfg: DeepseekConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.weight = empty_param(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32)
        noaux = cfg.topk_method == "noaux_tc"
        self.e_score_correction_bias = empty_param(cfg.n_routed_experts, dtype=torch.float32) if noaux else None

    def forward(self, x: torch.Tensor, shared: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k + shared], float32 weights [T, k + shared]): the k routed, then
        the `shared` experts stacked after the routed ones (ids n_routed_experts..) at weight 1."""
        cfg = self.cfg
        k = cfg.num_experts_per_tok
        if cfg.topk_method == "greedy" and route_runs(x):  # decode steps on CUDA: one launch, not four
            softmax = cfg.scoring_func == "softmax"
            scaling = cfg.routed_scaling_factor
            return moe_kernels.route(x, self.weight, k, softmax, cfg.norm_topk_prob, scaling, shared)
        ids, weights = self._routed(x)
        if not shared:
            return ids, weights
        tokens = x.shape[0]
        shared_ids = torch.arange(cfg.n_routed_experts, cfg.n_routed_experts + shared, device=x.device)
        return (
            torch.cat([ids, shared_ids.expand(tokens, -1)], dim=1),
            torch.cat([weights, weights.new_ones(tokens, shared)], dim=1),
        )

    def _routed(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        k = cfg.num_experts_per_tok
        logits = F.linear(x.float(), self.weight)
        scores = logits.softmax(dim=-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
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
        if cfg.routed_scaling_factor == 1.0:  # V2-Lite's: x * 1.0 is x, one launch fewer a layer
            return ids, weights
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
    """The experts stacked, routed ones first, then the shared ones ([E + S, 2I, H] gate/up and [E + S, H, I]
    down, I = moe_intermediate_size), and the router. With a shard of an expert-parallel group E is the
    shard's routed experts (global ids shard.experts(n_routed_experts)); the router stays whole."""

    def __init__(self, cfg: DeepseekConfig, shard: ExpertShard = WHOLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.routed = shard.experts(cfg.n_routed_experts)  # the global ids of the routed experts held here
        self.shared = cfg.n_shared_experts
        size, experts = cfg.moe_intermediate_size, len(self.routed) + self.shared
        self.gate = TopkRouter(cfg)
        self.experts_gate_up = empty_param(experts, 2 * size, cfg.hidden_size)
        self.experts_down = empty_param(experts, cfg.hidden_size, size)
        self.exchange = None  # expert_parallel.exchange.ExpertExchange: runs the layer across the group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.exchange is not None:
            return self.exchange.run(self, x)
        ids, weights = self.route(x)
        return self.experts(x, ids, weights)

    def by_rows(self, h: torch.Tensor, rows: int) -> torch.Tensor:
        """residual_stream.mlp_by_rows' call: across the group the exchange sets the chunks (every rank must make
        as many exchanges a layer), on one rank `rows` rows at a time."""
        if self.exchange is not None:
            return self.exchange.by_rows(self, h)
        return residual_stream_rows(self, h, rows)

    def experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The weighted sum of each token's experts (ids: local expert rows, -1 for a slot served elsewhere, which
        only the experts_hit path is given), in out_dtype (default x's)."""
        if grouped_gemm_runs(x):
            return self.grouped_experts(x, ids, weights, out_dtype)
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.every_expert(x, ids, weights, out_dtype)
        return self.experts_hit(x, ids, weights, out_dtype)

    def serves_masked_slots(self, x: torch.Tensor) -> bool:
        """Whether experts() takes -1 for a slot served elsewhere (else such a slot must name a real row at
        weight 0): the experts_hit path skips them."""
        return not grouped_gemm_runs(x) and not (x.is_cuda and torch.cuda.is_current_stream_capturing())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and weights, the shared experts' slots included: [T, k + S] each."""
        return self.gate(x, self.shared)

    def experts_hit(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The experts' weighted sum (the shared ones' slots included), each expert over the tokens routed to it."""
        out = torch.zeros_like(x, dtype=out_dtype or x.dtype)
        # The experts this batch hit, ascending (one host sync: fine for the CPU path, see the module doc).
        for expert in torch.unique(ids).tolist():
            if expert < 0:
                continue  # a slot another rank of the group serves
            tokens, slot = torch.where(ids == expert)
            h = F.linear(x[tokens], self.experts_gate_up[expert])
            h = F.linear(fused_ops.silu_and_mul_reference(h), self.experts_down[expert])
            out.index_add_(0, tokens, (h * weights[tokens, slot, None]).to(out.dtype))
        return out

    def grouped_experts(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The same sum by two grouped GEMMs over the (token, slot) pairs sorted by expert, with no host sync.
        On CUDA small batches (decode steps) sort by moe_kernels.align and run the experts by moe_mlp_kernel
        (weight-streaming kernels for a few rows an expert) instead of the grouped GEMMs; large ones (prefill
        chunks) sort by a PyTorch argsort; both sum by moe_kernels.combine. The CPU (where the tests run this
        path in float32) does it all in PyTorch. ids and weights as route gives them: align places the shared
        experts' slots (the last) without sorting them."""
        tokens, k = ids.shape
        dtype = out_dtype or x.dtype
        if tokens == 0:
            return torch.zeros_like(x, dtype=dtype)
        experts = self.experts_gate_up.shape[0]
        kernels = fused_ops.kernels_available(x.device)
        if kernels and tokens * k <= moe_kernels.ALIGN_MAX_PAIRS:
            token_of_row, row_of_pair, ends = moe_kernels.align(ids, experts, self.shared)
            h = moe_mlp_kernel.expert_mlp(x, self.experts_gate_up, self.experts_down, token_of_row, ends)
            return moe_kernels.combine(h, weights, row_of_pair, dtype)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pair index (token * k + slot), grouped by expert
        # Runs' ends from a scatter-add, not bincount: bincount sizes its output on the host (a sync).
        counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        ends = counts.cumsum(0, dtype=torch.int32)
        token_of_row = order // k
        if kernels:  # each pair's row, for the combine kernel: the inverse of the sort
            pairs = order.numel()
            row_of_pair = torch.empty(pairs, dtype=torch.int32, device=x.device)
            row_of_pair.scatter_(0, order, torch.arange(pairs, dtype=torch.int32, device=x.device))
        rows = x.index_select(0, token_of_row)
        # [E, 2I, H] seen as [E, H, 2I] (column-major per expert: what the grouped kernel takes, no copy)
        h = torch._grouped_mm(rows, self.experts_gate_up.transpose(1, 2), offs=ends)
        h = torch._grouped_mm(_silu_and_mul(h), self.experts_down.transpose(1, 2), offs=ends)
        if kernels:  # one pass over h (prefill chunks: the PyTorch sum below moved it ~6 times in float32)
            return moe_kernels.combine(h, weights, row_of_pair, dtype)
        h = h.float() * weights.reshape(-1).index_select(0, order).unsqueeze(1)
        slots = torch.empty_like(h)
        slots.index_copy_(0, order, h)  # back to (token, slot) order
        return slots.view(tokens, k, -1).sum(dim=1).to(dtype)

    def every_expert(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The same sum with no host sync: every expert over every token, its output weighted by the token's
        routing weight for it (0 where not chosen), added in expert order as experts_hit adds."""
        out = torch.zeros_like(x, dtype=out_dtype or x.dtype)
        experts = self.experts_gate_up.shape[0]
        routing = torch.zeros(x.shape[0], experts, dtype=weights.dtype, device=x.device)
        # an add, not a scatter: across a group a slot served elsewhere names a real row at weight 0
        routing.scatter_add_(1, ids, weights)  # [T, experts]
        for expert in range(experts):
            h = F.linear(x, self.experts_gate_up[expert])
            h = F.linear(fused_ops.silu_and_mul_reference(h), self.experts_down[expert])
            out += (h * routing[:, expert, None]).to(out.dtype)
        return out

    def hf_targets(self, prefix: str) -> dict[str, torch.Tensor | Rearranged]:
        """HF tensor name -> the part of our parameters it fills: the router, the routed experts this shard
        holds (global id e in local row e - routed.start) and the shared experts (the rows after them)."""
        size, hidden = self.cfg.moe_intermediate_size, self.cfg.hidden_size
        targets: dict[str, torch.Tensor | Rearranged] = {f"{prefix}.gate.weight": self.gate.weight}
        if self.gate.e_score_correction_bias is not None:
            targets[f"{prefix}.gate.e_score_correction_bias"] = self.gate.e_score_correction_bias
        for row, e in enumerate(self.routed):
            targets[f"{prefix}.experts.{e}.gate_proj.weight"] = self.experts_gate_up[row, :size]
            targets[f"{prefix}.experts.{e}.up_proj.weight"] = self.experts_gate_up[row, size:]
            targets[f"{prefix}.experts.{e}.down_proj.weight"] = self.experts_down[row]
        routed = len(self.routed)
        if self.shared:
            # the shared MLP's intermediate dims, cut into S experts of `size` each: gate/up rows s*size.., down
            # columns s*size.. (the MLP is the sum of its slices' MLPs)
            s, shared = self.shared, f"{prefix}.shared_experts"
            by_rows = (s * size, hidden)
            targets[f"{shared}.gate_proj.weight"] = Rearranged(
                self.experts_gate_up[routed:, :size], by_rows, lambda t: t.view(s, size, hidden)
            )
            targets[f"{shared}.up_proj.weight"] = Rearranged(
                self.experts_gate_up[routed:, size:], by_rows, lambda t: t.view(s, size, hidden)
            )
            targets[f"{shared}.down_proj.weight"] = Rearranged(
                self.experts_down[routed:], (hidden, s * size), lambda t: t.view(hidden, s, size).transpose(0, 1)
            )
        return targets
