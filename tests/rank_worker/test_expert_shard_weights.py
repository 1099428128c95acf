"""Weights per expert shard: a rank of an expert-parallel group of R holds 1/R of every MoE layer's routed
experts and everything else whole. Random weights give it the whole model's values for the same seed, and it
reads from safetensors and GGUF only its own experts' tensors (the others never leave the disk), equal to the
whole model's rows; shapes that do not split, and models with no experts to split, are refused."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from deepseek_checkpoints import V2, V3, write_deepseek
from test_deepseek_gguf import write_deepseek_gguf

from contracts.config import KvServeConfig
from rank_worker.engine.factory import build_engine, build_model, weight_memory
from rank_worker.expert_parallel.shard import WHOLE, ExpertShard
from rank_worker.model.deepseek import DeepseekForCausalLM
from rank_worker.model.moe import MoE
from rank_worker.model_files import gguf_deepseek, hf_dir
from rank_worker.model_files.opener import open_model_source
from rank_worker.model_files.source import ModelSource

CPU = torch.device("cpu")
CONFIGS = {"deepseek_v2": V2, "deepseek_v3": V3}  # 8 routed experts; V2 two shared, V3 one
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
GROUPS = [(size, rank) for size in (2, 4) for rank in range(size)]


def build(source: ModelSource, shard: ExpertShard = WHOLE, scheme: str = "normal") -> DeepseekForCausalLM:
    model = build_model(source, CPU, torch.float32, max_positions=256, seed=7, random_weights=scheme, shard=shard)
    assert isinstance(model, DeepseekForCausalLM)
    return model


def assert_shard_of(shard_model: DeepseekForCausalLM, whole: DeepseekForCausalLM) -> None:
    """Every parameter of the shard equals the whole model's: exactly, or for an expert stack the rows of the
    shard's global expert ids, then the shared experts' rows."""
    whole_params = dict(whole.named_parameters())
    stacks = 0
    for name, param in shard_model.named_parameters():
        full = whole_params[name]
        owner, _, leaf = name.rpartition(".")
        module = shard_model.get_submodule(owner)
        if isinstance(module, MoE) and leaf in ("experts_gate_up", "experts_down"):
            held = len(module.routed)
            n_routed = whole.cfg.n_routed_experts
            assert param.shape[0] == held + module.shared < full.shape[0], name
            assert torch.equal(param[:held], full[module.routed.start : module.routed.stop]), name
            assert torch.equal(param[held:], full[n_routed:]), name
            stacks += 1
        else:
            assert torch.equal(param, full), name
    assert stacks == 2 * sum(isinstance(layer.mlp, MoE) for layer in whole.layers) > 0


def dummy_source(model_type: str, directory: Path) -> ModelSource:
    config = dict(CONFIGS[model_type], model_type=model_type)
    if model_type == "deepseek_v3":
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return open_model_source(str(directory / "config.json"))


# ---------------------------------------------------------------- random weights


@pytest.mark.parametrize("scheme", ["normal", "uniform"])
@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3"])
def test_random_weights_of_every_shard_are_the_whole_models(model_type: str, scheme: str, tmp_path: Path) -> None:
    source = dummy_source(model_type, tmp_path)
    whole = build(source, scheme=scheme)
    stack = whole.layers[1].mlp.experts_gate_up
    assert not torch.equal(stack[0], stack[1])  # each expert drawn apart, not one row repeated
    assert not torch.equal(stack[0], stack[-1])  # nor a shared expert the same as a routed one
    for size, rank in GROUPS:
        assert_shard_of(build(source, ExpertShard(rank, size), scheme), whole)


def test_a_parameters_draw_depends_on_its_name_not_on_the_others(tmp_path: Path) -> None:
    """normal: each parameter from a generator seeded by a stable hash (blake2b, not Python's hash()) of (seed,
    name), each expert row by (seed, name, global id) or (seed, name, "shared", s): layers differ, another seed
    draws others, and the values are the rule's, written out here apart from the code."""
    source = dummy_source("deepseek_v2", tmp_path)
    model = build(source)
    first, second = model.layers[1].mlp, model.layers[2].mlp
    assert not torch.equal(first.experts_gate_up, second.experts_gate_up)
    assert not torch.equal(first.gate.weight, second.gate.weight)
    again = build_model(source, CPU, torch.float32, max_positions=256, seed=8)
    assert not torch.equal(again.embed_tokens, model.embed_tokens)

    def drawn(like: torch.Tensor, *parts: object) -> torch.Tensor:
        text = "\x1f".join(str(part) for part in (7, *parts)).encode()
        seed = int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1
        return torch.empty_like(like).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(model.embed_tokens, drawn(model.embed_tokens, "embed_tokens"))
    name = "layers.2.mlp.experts_down"
    assert torch.equal(second.experts_down[5], drawn(second.experts_down[5], name, 5))
    assert torch.equal(second.experts_down[9], drawn(second.experts_down[9], name, "shared", 1))  # 8 routed, 2 shared


# ---------------------------------------------------------------- safetensors


class SafetensorsSpy:
    """Stands in for safetensors.safe_open in hf_dir and records every tensor read."""

    def __init__(self, real: Any) -> None:
        self.real, self.read = real, []

    def __call__(self, *args: Any, **kwargs: Any) -> SpyHandle:
        return SpyHandle(self.real(*args, **kwargs), self.read)


class SpyHandle:
    def __init__(self, handle: Any, read: list[str]) -> None:
        self.handle, self.read = handle, read

    def __enter__(self) -> SpyHandle:
        self.handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return self.handle.keys()

    def get_tensor(self, name: str) -> torch.Tensor:
        self.read.append(name)
        return self.handle.get_tensor(name)


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp(request.param)
    write_deepseek(request.param, directory)
    return directory


def experts_by_layer(names: list[str]) -> dict[int, set[int]]:
    found: dict[int, set[int]] = {}
    for name in names:
        match = EXPERT.match(name)
        if match is not None:
            found.setdefault(int(match[1]), set()).add(int(match[2]))
    return found


def test_each_shard_reads_only_its_experts_from_safetensors(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = open_model_source(str(checkpoint))
    whole = build(source)
    all_names = [name for name, _ in source.load_weights()]
    moe_layers = [i for i, layer in enumerate(whole.layers) if isinstance(layer.mlp, MoE)]
    assert experts_by_layer(all_names) == {i: set(range(8)) for i in moe_layers}
    spy = SafetensorsSpy(hf_dir.safe_open)
    monkeypatch.setattr(hf_dir, "safe_open", spy)
    for size, rank in GROUPS:
        spy.read.clear()
        shard = ExpertShard(rank, size)
        model = build(source, shard)
        held = set(shard.experts(8))
        assert experts_by_layer(spy.read) == {i: held for i in moe_layers}  # the others never read
        assert len(spy.read) == len(set(spy.read))  # and nothing twice
        others = [name for name in all_names if EXPERT.match(name) is None]
        assert set(others) <= set(spy.read)  # everything else whole
        assert_shard_of(model, whole)


def test_a_loader_without_the_filter_still_loads_a_shard(checkpoint: Path) -> None:
    """load_hf_weights skips other ranks' experts itself (a loader handed every tensor still fills a shard)."""
    source = open_model_source(str(checkpoint))
    whole = build(source)
    model = build_model(source, CPU, torch.float32, 256, seed=0, shard=ExpertShard(1, 2))
    assert isinstance(model, DeepseekForCausalLM)
    model.load_hf_weights(source.load_weights())
    assert_shard_of(model, whole)
    assert model.skipped_by_shard("model.layers.1.mlp.experts.0.up_proj.weight")
    assert not model.skipped_by_shard("model.layers.1.mlp.experts.4.up_proj.weight")
    assert not model.skipped_by_shard("model.layers.0.mlp.experts.0.up_proj.weight")  # dense: refused by name
    assert not model.skipped_by_shard("model.layers.1.mlp.shared_experts.up_proj.weight")
    assert not whole.skipped_by_shard("model.layers.1.mlp.experts.0.up_proj.weight")


# ---------------------------------------------------------------- GGUF


@pytest.mark.parametrize("quantize", [None, gguf.GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_each_shard_dequantizes_only_its_experts_from_gguf(
    checkpoint: Path, quantize: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = open_model_source(str(write_deepseek_gguf(checkpoint, tmp_path / "model.gguf", True, quantize=quantize)))
    whole = build(source)
    real = gguf_deepseek.dequantized
    dequantized: list[tuple[str, int | None]] = []

    def spy(tensor: Any, index: int | None = None) -> torch.Tensor:
        dequantized.append((tensor.name, index))
        return real(tensor, index)

    monkeypatch.setattr(gguf_deepseek, "dequantized", spy)
    moe_layers = [i for i, layer in enumerate(whole.layers) if isinstance(layer.mlp, MoE)]
    for size, rank in GROUPS:
        dequantized.clear()
        shard = ExpertShard(rank, size)
        model = build(source, shard)
        stacks = [(name, index) for name, index in dequantized if "_exps." in name]
        assert len(stacks) == 3 * len(moe_layers) * len(shard.experts(8))
        assert {index for _, index in stacks} == set(shard.experts(8))  # one expert's rows at a time, its own
        assert all(index is None for name, index in dequantized if "_exps." not in name)
        assert_shard_of(model, whole)


def test_gguf_loader_counts_only_the_kept_tensors(checkpoint: Path, tmp_path: Path) -> None:
    source = open_model_source(str(write_deepseek_gguf(checkpoint, tmp_path / "model.gguf", True)))
    everything = [name for name, _ in source.load_weights()]
    shard = build(source, ExpertShard(0, 4))
    kept = [name for name, _ in source.load_weights(shard.skipped_by_shard)]
    assert kept == [name for name in everything if not shard.skipped_by_shard(name)]
    assert experts_by_layer(kept) == {i: {0, 1} for i in experts_by_layer(everything)}


# ---------------------------------------------------------------- memory and refusals


def test_weight_memory_reports_the_shard_and_the_whole_model(tmp_path: Path) -> None:
    source = dummy_source("deepseek_v3", tmp_path)
    whole = build(source)
    whole_bytes = sum(p.numel() * p.element_size() for p in whole.parameters())
    assert re.fullmatch(r"weights: [\d.]+ GB on cpu", weight_memory(whole))
    for size, rank in GROUPS:
        shard = ExpertShard(rank, size)
        model = build(source, shard)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        stacks = [m for m in model.modules() if isinstance(m, MoE)]
        routed = sum(len(m.routed) * p[0].numel() * p.element_size() for m in stacks for p in m.parameters(False))
        assert held + routed * (size - 1) == whole_bytes  # "what the whole model takes" is the whole model's
        line = weight_memory(model, shard)
        assert f"expert-parallel rank {rank} of {size}: 1/{size} of the routed experts" in line
        assert line.endswith(f"the whole model takes {whole_bytes / 1e9:.2f} GB)")


def test_a_group_that_does_not_divide_the_experts_is_refused(tmp_path: Path) -> None:
    source = dummy_source("deepseek_v2", tmp_path)
    with pytest.raises(ValueError, match="expert_parallel_size 3 does not divide the model's 8 routed experts"):
        build(source, ExpertShard(0, 3))
    with pytest.raises(ValueError, match="expert-parallel rank 2 is outside a group of 2"):
        ExpertShard(2, 2)


def test_a_model_without_routed_experts_is_refused(tmp_path: Path) -> None:
    llama = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96}
    llama |= {"num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    config = KvServeConfig(model=str(tmp_path / "config.json"), device="cpu", num_kv_blocks=4, expert_parallel_size=2)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match=r"expert parallelism needs a MoE model .* set expert_parallel_size 1"):
        build_engine(config)
    dense = dummy_source("deepseek_v3", tmp_path / "dense")
    dense.hf_config["n_routed_experts"] = 0
    with pytest.raises(ValueError, match="expert parallelism needs a MoE model"):
        build(dense, ExpertShard(1, 2))
