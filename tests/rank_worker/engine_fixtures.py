"""Shared builders for engine tests: tiny random checkpoints written by transformers, and engines over
an already-loaded model (loading is the slow part; an engine around it is cheap)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from contracts.config import EngineConfig, SchedulingConfig
from rank_worker.engine.interface import EngineRequest, RequestOutput, SamplingParams, TokenizerBundle
from rank_worker.engine.paged_engine import EngineSettings, PagedEngine
from rank_worker.model.llama import LlamaForCausalLM


def write_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A throwaway tokenizer.json so a random checkpoint is a complete Hugging Face directory."""
    vocab = {f"w{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": f"w{vocab_size - 1}"}))


def engine_settings(**values: Any) -> EngineSettings:
    """EngineSettings from flat keys, as a config file writes them: the engine and scheduling sections' go into
    them."""
    engine = {key: values.pop(key) for key in list(values) if key in EngineConfig.model_fields}
    scheduling = {key: values.pop(key) for key in list(values) if key in SchedulingConfig.model_fields}
    return EngineSettings(**values, engine=EngineConfig(**engine), scheduling=SchedulingConfig(**scheduling))


def make_engine(model: LlamaForCausalLM, tokenizer: TokenizerBundle | None = None, **overrides: object) -> PagedEngine:
    values: dict[str, object] = {"num_blocks": 128, "block_size": 16, "max_model_len": 2048}
    values.update(overrides)
    return PagedEngine(model, engine_settings(**values), tokenizer)


def run_to_completion(engine: PagedEngine, max_steps: int = 100_000) -> dict[str, RequestOutput]:
    """Step until idle; returns each request's final output with all its tokens gathered."""
    tokens: dict[str, list[int]] = {}
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                out.new_token_ids = tokens[out.request_id]
                finals[out.request_id] = out
    else:
        raise AssertionError(f"engine still busy after {max_steps} steps")
    return finals


def greedy(max_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def generate_one(
    engine: PagedEngine, prompt: list[int], params: SamplingParams, request_id: str = "r"
) -> RequestOutput:
    engine.add_request(EngineRequest(request_id, list(prompt), params))
    return run_to_completion(engine)[request_id]


def generate_greedy(engine: PagedEngine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """All prompts at once (greedy, prompt i generating lengths[i] tokens); each one's tokens, in order."""
    for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
        engine.add_request(EngineRequest(f"g{i}", prompt, greedy(n)))
    outputs = run_to_completion(engine)
    return [outputs[f"g{i}"].new_token_ids for i in range(len(prompts))]


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=gen).tolist()


def embolden_weights(model: torch.nn.Module) -> None:
    """Random init leaves some tensors tiny; bolder weights put greedy argmax far from ties."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.15)
