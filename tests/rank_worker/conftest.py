from __future__ import annotations

import pytest
import torch

from rank_worker.engine.factory import build_model, resolve_dtype
from rank_worker.engine.interface import TokenizerBundle
from rank_worker.model.llama import LlamaForCausalLM
from rank_worker.model_files.source import open_model_source


@pytest.fixture(scope="session")
def smollm2() -> tuple[LlamaForCausalLM, TokenizerBundle]:
    """The embedded SmolLM2-135M-Instruct (GGUF), loaded once per test process, float32 on the CPU."""
    source = open_model_source("")
    assert source.tokenizer is not None
    device = torch.device("cpu")
    model = build_model(source, device, resolve_dtype("auto", device), max_positions=4096, seed=0)
    return model, source.tokenizer
