from __future__ import annotations

import pytest
import torch

from rank_worker.engine.factory import build_model, resolve_dtype
from rank_worker.engine.interface import TokenizerBundle
from rank_worker.model.causal_lm import CausalLM
from rank_worker.model.llama import LlamaForCausalLM
from rank_worker.model_files.opener import open_model_source


@pytest.fixture(scope="session")
def smollm2() -> tuple[LlamaForCausalLM, TokenizerBundle]:
    """The embedded SmolLM2-135M-Instruct (GGUF), loaded once per test process, float32 on the CPU."""
    source = open_model_source("")
    assert source.tokenizer is not None
    device = torch.device("cpu")
    model = build_model(source, device, resolve_dtype("auto", device), max_positions=4096, seed=0)
    return model, source.tokenizer


@pytest.fixture(scope="session")
def deepseek_v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[CausalLM, TokenizerBundle]:
    """A tiny random DeepSeek-V3 (MLA + MoE) checkpoint written by transformers, loaded by our engine once."""
    from deepseek_checkpoints import load_ours, write_deepseek

    directory = tmp_path_factory.mktemp("deepseek-v3")
    write_deepseek("deepseek_v3", directory)
    return load_ours(directory)


@pytest.fixture(params=["smollm2", "deepseek_v3"])
def engine_model(request: pytest.FixtureRequest) -> tuple[CausalLM, TokenizerBundle]:
    """Each model family in turn, for engine tests that hold for any model (random prompts, no chat text)."""
    return request.getfixturevalue(request.param)
