"""Which attention backend a rank takes (choose_backend), on this machine: auto is SDPA without CUDA, whatever
is installed; the CUDA backends asked for by name fail loudly without CUDA; FlashInfer is never taken where
it cannot run (flashinfer_backend.usable says no on a CPU, or without FlashInfer's prebuilt modules)."""

from __future__ import annotations

import pytest
import torch

from rank_worker.model.attention import flashinfer_backend
from rank_worker.model.attention.backend import choose_backend
from rank_worker.model.attention.sdpa_backend import SdpaAttention

CPU = torch.device("cpu")


def test_auto_is_sdpa_on_the_cpu() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert isinstance(choose_backend("auto", CPU, dtype, 8, 64, 4), SdpaAttention)
    assert isinstance(choose_backend("sdpa", CPU, torch.float32, 8, 64, 4), SdpaAttention)


@pytest.mark.parametrize("setting", ["triton", "flashinfer"])
def test_a_cuda_backend_by_name_fails_without_cuda(setting) -> None:
    with pytest.raises(RuntimeError, match=setting):
        choose_backend(setting, CPU, torch.bfloat16, 8, 64, 4)


def test_flashinfer_is_not_usable_on_a_cpu_or_in_float32() -> None:
    assert not flashinfer_backend.usable(CPU, torch.bfloat16, 8, 2, 128)
    assert not flashinfer_backend.usable(torch.device("cuda"), torch.float32, 8, 2, 128)
