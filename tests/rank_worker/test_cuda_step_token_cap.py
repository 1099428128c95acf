"""On CUDA (skipped elsewhere): a step that really runs out of GPU memory (the caching allocator's
torch.OutOfMemoryError, this process held to a share of the GPU by set_per_process_memory_fraction, so other
tests on the GPU are untouched) is dropped and run again smaller, and the request gets the tokens of a run that
never ran out. test_step_token_cap.py checks the same on the CPU with a model that raises the error itself."""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import greedy, make_engine, random_prompt, run_to_completion

from rank_worker.engine.interface import EngineRequest
from rank_worker.engine.paged_engine import PagedEngine
from rank_worker.model.config import LlamaFamilyConfig
from rank_worker.model.llama import LlamaForCausalLM

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# wide MLP rows: a step's activations (tokens x 8192 x 4 bytes, three of them) dwarf the weights' share of a step
WIDE = {
    "vocab_size": 256,
    "hidden_size": 256,
    "intermediate_size": 8192,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}
PROMPT = 4000
BUDGET = 4096


def _run(engine: PagedEngine, prompt: list[int]) -> list[int]:
    engine.add_request(EngineRequest("r", prompt, greedy(8)))
    return run_to_completion(engine)["r"].new_token_ids


def test_a_step_that_runs_out_of_cuda_memory_is_run_again_smaller() -> None:
    device = torch.device("cuda")
    with torch.device(device):
        model = LlamaForCausalLM(LlamaFamilyConfig.from_hf(WIDE), max_positions=8192)
    model.init_random_weights(0)
    model.eval()
    prompt = random_prompt(PROMPT, WIDE["vocab_size"], seed=1)
    settings = dict(num_blocks=600, max_model_len=8192, max_num_batched_tokens=BUDGET, max_num_seqs=8)

    reference = make_engine(model, **settings)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    expected = _run(reference, prompt)  # its prompt in one step of 4000 tokens
    extra = torch.cuda.max_memory_reserved() - base
    assert extra > 64 << 20, extra  # the step's activations, far past the allocator's rounding
    del reference
    torch.cuda.empty_cache()

    engine = make_engine(model, **settings)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    limit = torch.cuda.memory_reserved() + extra // 2  # room for a step of about half the prompt, not all of it
    index = torch.cuda.current_device()  # the fraction takes an index ("cuda" alone is refused)
    total = torch.cuda.get_device_properties(index).total_memory
    torch.cuda.set_per_process_memory_fraction(limit / total, index)
    try:
        got = _run(engine, prompt)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, index)
    stats = engine.stats()
    assert stats.oom_dropped_steps >= 1 and 0 < stats.step_token_cap <= PROMPT // 2
    assert got == expected
    assert stats.used_blocks == 0
