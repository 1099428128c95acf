"""A model's MoE layers joined to an expert-parallel group: one exchange for all of them, and the lockstep the
engine steps by."""

from __future__ import annotations

from torch import nn

from rank_worker.expert_parallel.exchange import ExpertExchange
from rank_worker.expert_parallel.group import ExpertGroup
from rank_worker.expert_parallel.lockstep import Lockstep
from rank_worker.model.moe import MoE


def join_group(model: nn.Module, group: ExpertGroup) -> Lockstep:
    """Every MoE layer of `model` (built with the group's shard) exchanges across `group` from now on."""
    exchange = ExpertExchange(group)
    layers = [module for module in model.modules() if isinstance(module, MoE)]
    if not layers:
        raise ValueError("expert parallelism needs a MoE model: this one has no MoE layer")
    for layer in layers:
        if layer.shard.size != group.size or layer.shard.rank != group.rank:
            raise ValueError(f"a MoE layer holds shard {layer.shard}, not rank {group.rank} of {group.size}")
        layer.exchange = exchange
    return Lockstep(group, exchange)
