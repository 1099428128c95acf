"""Which path MoE's routing takes (moe.py): the one-launch route kernel only for decode-sized CUDA batches, and
the choice made per batch (a cached answer would be keyed by the tensor's identity, and ids are reused)."""

from __future__ import annotations

import torch

from rank_worker.model import moe, moe_kernels


def test_route_runs_never_on_the_cpu_and_not_past_decode_sizes() -> None:
    assert not moe.route_runs(torch.zeros(1, 8))
    assert not moe.route_runs(torch.zeros(moe_kernels.ROUTE_MAX_TOKENS + 1, 8))


def test_the_choice_is_made_per_batch_and_the_device_capability_is_asked_once() -> None:
    assert not hasattr(moe.route_runs, "cache_info")
    assert hasattr(moe._capability, "cache_info")
