"""Which attention backend a rank takes (choose_backend), on this machine: auto is SDPA without CUDA, whatever
is installed; the CUDA backends asked for by name fail loudly without CUDA; FlashInfer is never taken where
it cannot run (flashinfer_backend.usable says no on a CPU, or without FlashInfer's prebuilt modules)."""

from __future__ import annotations

import pytest
import torch

from rank_worker.model.attention import fa4_backend, flashinfer_backend
from rank_worker.model.attention.sdpa_backend import SdpaAttention
from rank_worker.model.attention.selector import choose_backend

CPU = torch.device("cpu")


def test_auto_is_sdpa_on_the_cpu() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert isinstance(choose_backend("auto", CPU, dtype, 8, 64, 4), SdpaAttention)
    assert isinstance(choose_backend("sdpa", CPU, torch.float32, 8, 64, 4), SdpaAttention)


@pytest.mark.parametrize("setting", ["triton", "fa4", "flashinfer"])
def test_a_cuda_backend_by_name_fails_without_cuda(setting) -> None:
    with pytest.raises(RuntimeError, match=setting):
        choose_backend(setting, CPU, torch.bfloat16, 8, 64, 4)


def test_flashinfer_is_not_usable_on_a_cpu_or_in_float32() -> None:
    assert not flashinfer_backend.usable(CPU, torch.bfloat16, 8, 2, 128)
    assert not flashinfer_backend.usable(torch.device("cuda"), torch.float32, 8, 2, 128)


def test_fa4_is_not_usable_on_a_cpu_or_in_float32() -> None:
    """fa4_backend.usable asks for an SM90 CUDA device and 16-bit K/V before it imports anything."""
    assert not fa4_backend.usable(CPU, torch.bfloat16)
    assert not fa4_backend.usable(torch.device("cuda"), torch.float32)


def test_fa4_plan_lays_out_the_steps_chunks_as_a_varlen_batch_over_block_table_rows() -> None:
    """The plan FA4 runs from (no kernel here): chunks in token order after the decode rows, cu_seqlens_q from
    the first chunk's row, each chunk's context length, its block-table row as the page table; a step of
    decode rows only has no plan; chunks that are not adjacent are refused."""
    from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice

    table = torch.arange(5 * 4, dtype=torch.int32).view(5, 4)
    zeros = torch.zeros(40, dtype=torch.long)
    backend = fa4_backend.Fa4Attention(torch.bfloat16, 4)
    pieces = [PrefillSlice(12, 20, 52, 3), PrefillSlice(2, 10, 10, 1)]  # given out of order; the second is cold
    batch = ForwardBatch(zeros, zeros, zeros, zeros, zeros[:0], table, num_decodes=2, prefills=pieces)
    backend.plan(batch)
    plan = batch.attention
    assert plan.span == (2, 32) and plan.max_q == 20
    assert plan.cu_q.tolist() == [0, 10, 30]
    assert plan.used_k.tolist() == [10, 52]
    assert plan.pages.tolist() == [table[1].tolist(), table[3].tolist()]
    decodes_only = ForwardBatch(zeros[:2], zeros[:2], zeros[:2], zeros[:2], zeros[:2], table, num_decodes=2)
    backend.plan(decodes_only)
    assert decodes_only.attention is None
    gap = ForwardBatch(
        zeros, zeros, zeros, zeros, zeros[:0], table, prefills=[PrefillSlice(0, 4, 4, 0), PrefillSlice(5, 2, 2, 1)]
    )
    with pytest.raises(RuntimeError, match="adjacent"):
        backend.plan(gap)


def test_mla_fa4_prefill_falls_back_to_sdpa_when_its_warm_up_fails() -> None:
    """A rank whose FA4 does not run (here: not installed) keeps serving: warm_up logs, turns FA4 prefill off
    and the SDPA prefill serves (the engine's start-up calls warm_up before any request)."""
    from rank_worker.model.attention.mla_triton import MlaTritonAttention

    backend = MlaTritonAttention((4, 24, 16, torch.bfloat16))
    assert backend.fa4_prefill
    assert backend.warm_up(torch.empty(1)) == 0.0
    assert not backend.fa4_prefill and backend.fa4_shape is None
