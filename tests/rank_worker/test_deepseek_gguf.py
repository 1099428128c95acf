"""DeepSeek-V2/V3 from GGUF files laid out as llama.cpp's converter writes them (arch deepseek2: stacked 3-D
experts, exp_probs_b.bias, kv_b_proj kept whole or split into attn_k_b/attn_v_b), against the same tiny
checkpoints loaded from safetensors: identical weights, the same config, logits within float32 tolerance and
the same greedy tokens; then the refusals."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from deepseek_checkpoints import VOCAB, write_deepseek
from engine_fixtures import generate_one, greedy, make_engine, random_prompt
from safetensors.torch import load_file

from rank_worker.engine.factory import build_model
from rank_worker.model.deepseek_config import DeepseekConfig
from rank_worker.model.forward_batch import ForwardBatch, PrefillSlice
from rank_worker.model_files import ModelPathError, ModelSource, open_model_source

# HF -> llama.cpp names (gguf-py's tensor_mapping for MODEL_ARCH.DEEPSEEK2), written out independently of the
# module under test.
HF_TO_GGUF_LEAF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.q_a_proj": "attn_q_a",
    "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
    "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.gate.e_score_correction": "exp_probs_b",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
    "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp",
}
TOP_LEVEL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def converted_tensors(config: dict[str, Any], state: dict[str, torch.Tensor], split_kv_b: bool) -> dict[str, Any]:
    """What llama.cpp's convert_hf_to_gguf (conversion/deepseek.py, DeepseekV2Model.modify_tensors) makes of a
    DeepSeek checkpoint, in HF (outermost-first) shapes: MTP layers skipped, each layer's experts stacked per
    projection with torch.stack(dim=0), e_score_correction_bias renamed to e_score_correction.bias, and in the
    split form kv_b_proj viewed as [heads, nope + v, rank], split into K and V rows, K transposed."""
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    nope, v_dim = config["qk_nope_head_dim"], config["v_head_dim"]
    out: dict[str, Any] = {}
    experts: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name in TOP_LEVEL:
            out[TOP_LEVEL[name]] = tensor
            continue
        name = name.replace("e_score_correction_bias", "e_score_correction.bias")
        _, _, layer, rest = name.split(".", 3)
        if int(layer) >= layers:
            continue  # the multi-token-prediction layer
        leaf, kind = rest.rsplit(".", 1)
        if leaf.startswith("mlp.experts."):
            _, _, expert, projection = leaf.split(".")
            experts.setdefault((layer, projection), {})[int(expert)] = tensor
        elif leaf == "self_attn.kv_b_proj" and split_kv_b:
            kv_b = tensor.view(heads, nope + v_dim, tensor.shape[-1])
            k_b, v_b = torch.split(kv_b, [nope, v_dim], dim=1)
            out[f"blk.{layer}.attn_k_b.weight"] = k_b.transpose(1, 2)
            out[f"blk.{layer}.attn_v_b.weight"] = v_b
        else:
            out[f"blk.{layer}.{HF_TO_GGUF_LEAF[leaf]}.{kind}"] = tensor
    short = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    for (layer, projection), by_id in experts.items():
        out[f"blk.{layer}.ffn_{short[projection]}_exps.weight"] = torch.stack([by_id[e] for e in sorted(by_id)])
    return {name: tensor.contiguous().numpy() for name, tensor in out.items()}


def converted_metadata(writer: gguf.GGUFWriter, config: dict[str, Any], split_kv_b: bool) -> None:
    """The metadata conversion/base.py (TextModel) and DeepseekV2Model.set_gguf_parameters write for it."""
    rope = config["rope_parameters"]
    kv_lora, rope_dim = config["kv_lora_rank"], config["qk_rope_head_dim"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_head_count(config["num_attention_heads"])
    # Split files: MLA as llama.cpp runs it absorbed, one KV head of the latent; older files: every head.
    writer.add_head_count_kv(1 if split_kv_b else config["num_attention_heads"])
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])
    if config["model_type"] == "deepseek_v3":
        # V3's own config.json says scoring_func: sigmoid (transformers does not write it); V2 files are left
        # without the key, as those converted before it existed, which llama.cpp reads as softmax.
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if rope["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_vocab_size(config["vocab_size"])
    if config["q_lora_rank"] is not None:
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(kv_lora)
    if split_kv_b:
        writer.add_key_length(kv_lora + rope_dim)
        writer.add_value_length(kv_lora)
        writer.add_key_length_mla(config["qk_nope_head_dim"] + rope_dim)
        writer.add_value_length_mla(config["v_head_dim"])
    else:
        writer.add_key_length(config["qk_nope_head_dim"] + rope_dim)
        writer.add_value_length(config["v_head_dim"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config["norm_topk_prob"]:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope_dim)
    if rope.get("mscale_all_dim") is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def write_deepseek_gguf(
    directory: Path,
    path: Path,
    split_kv_b: bool,
    edit: Any = None,
    quantize: gguf.GGMLQuantizationType | None = None,
) -> Path:
    """The GGUF llama.cpp would convert the checkpoint in `directory` to, float32 (the expert stacks in
    `quantize` if given); `edit(tensors)` may change the tensors before they are written."""
    config = json.loads((directory / "config.json").read_text())
    tensors = converted_tensors(config, load_file(directory / "model.safetensors"), split_kv_b)
    if edit is not None:
        edit(tensors)
    writer = gguf.GGUFWriter(str(path), "deepseek2")
    writer.add_name("tiny-" + config["model_type"])
    converted_metadata(writer, config, split_kv_b)
    for name, array in tensors.items():
        if quantize is not None and "_exps." in name:
            writer.add_tensor(name, gguf.quants.quantize(array, quantize), raw_dtype=quantize)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


PROMPT = random_prompt(41, VOCAB, seed=11)


@dataclasses.dataclass
class Checkpoint:
    directory: Path
    source: ModelSource  # the safetensors directory
    logits: torch.Tensor  # what our engine makes of it (run_prompt)
    tokens: list[int]


@pytest.fixture(scope="module", params=["deepseek_v2", "deepseek_v3"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """A tiny transformers checkpoint (V2: no q compression, group-limited routing, YaRN; V3: q compression,
    noaux_tc routing with its bias, a scaling factor) and our engine's outputs from its safetensors."""
    directory = tmp_path_factory.mktemp(request.param)
    write_deepseek(request.param, directory)
    source = open_model_source(str(directory))
    return Checkpoint(directory, source, *run_prompt(source, PROMPT))


def assert_same(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        if isinstance(value, dict):
            assert_same(ours[key], value)
        elif isinstance(value, float):
            assert ours[key] == pytest.approx(value, rel=1e-6), key
        else:
            assert ours[key] == value, key


def run_prompt(source: ModelSource, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    """Logits at every prompt position (one paged prefill) and 12 greedy tokens through the engine."""
    model = build_model(source, torch.device("cpu"), torch.float32, max_positions=512, seed=0)
    engine = make_engine(model, num_blocks=16, block_size=8, max_model_len=128)
    table = torch.arange(6)
    positions = torch.arange(len(prompt))
    batch = ForwardBatch(
        input_ids=torch.tensor(prompt),
        positions=positions,
        slot_blocks=table[positions // 8],
        slot_offsets=positions % 8,
        logits_indices=positions,
        block_tables=table.view(1, -1).to(torch.int32),
        prefills=[PrefillSlice(0, len(prompt), len(prompt), table_row=0)],
    )
    with torch.inference_mode():
        logits = model(batch, engine.kv_cache)
    out = generate_one(make_engine(model, num_blocks=32, block_size=8, max_model_len=128), prompt, greedy(12))
    return logits, out.new_token_ids


@pytest.mark.parametrize("split_kv_b", [True, False], ids=["split-kv-b", "kv-b"])
def test_gguf_loads_as_the_safetensors_checkpoint(checkpoint: Checkpoint, split_kv_b: bool, tmp_path: Path) -> None:
    reference = checkpoint.source
    path = write_deepseek_gguf(checkpoint.directory, tmp_path / "model.gguf", split_kv_b)
    source = open_model_source(str(path))

    expected = {name: tensor for name, tensor in reference.load_weights() if not name.startswith("model.layers.3.")}
    loaded = dict(source.load_weights())
    assert source.num_tensors == len(loaded) == len(expected)
    assert set(loaded) == set(expected)
    for name, tensor in loaded.items():
        assert torch.equal(tensor, expected[name].float()), name

    ours, theirs = DeepseekConfig.from_hf(source.hf_config), DeepseekConfig.from_hf(reference.hf_config)
    assert source.hf_config["model_type"] == reference.hf_config["model_type"]
    # GGUF keeps floats (rms_norm_eps, 0.1 * mscale_all_dim) in float32; it never counts the MTP layers.
    assert_same(dataclasses.asdict(ours), dataclasses.asdict(dataclasses.replace(theirs, num_mtp_layers=0)))

    logits, tokens = run_prompt(source, PROMPT)
    torch.testing.assert_close(logits, checkpoint.logits, rtol=1e-5, atol=1e-5)
    assert tokens == checkpoint.tokens


def test_quantized_expert_stacks_dequantize_one_expert_at_a_time(checkpoint: Checkpoint, tmp_path: Path) -> None:
    directory = checkpoint.directory
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = write_deepseek_gguf(directory, tmp_path / "q8.gguf", True, quantize=q8)
    loaded = dict(open_model_source(str(path)).load_weights())
    plain = dict(open_model_source(str(write_deepseek_gguf(directory, tmp_path / "f32.gguf", True))).load_weights())
    stack = torch.stack([plain[f"model.layers.2.mlp.experts.{e}.down_proj.weight"] for e in range(8)]).numpy()
    reference = gguf.quants.dequantize(gguf.quants.quantize(stack, q8), q8)  # the whole stack at once
    for e in range(8):
        assert torch.equal(loaded[f"model.layers.2.mlp.experts.{e}.down_proj.weight"], torch.from_numpy(reference[e]))
    assert not torch.equal(loaded["model.layers.2.mlp.experts.0.down_proj.weight"], torch.from_numpy(stack[0]))


# ---------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("v3")
    write_deepseek("deepseek_v3", directory)
    return directory


def test_unsupported_tensor_is_named(v3_dir: Path, tmp_path: Path) -> None:
    def fuse_layer_1(tensors: dict[str, Any]) -> None:
        # Newer llama.cpp files may fuse gate and up into one stack; we do not read that form.
        gate, up = tensors.pop("blk.1.ffn_gate_exps.weight"), tensors.pop("blk.1.ffn_up_exps.weight")
        tensors["blk.1.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)

    path = write_deepseek_gguf(v3_dir, tmp_path / "fused.gguf", True, edit=fuse_layer_1)
    with pytest.raises(ModelPathError, match=r"1 tensors with no deepseek2 equivalent: blk\.1\.ffn_gate_up_exps"):
        open_model_source(str(path))


def test_missing_layer_tensors_are_named(v3_dir: Path, tmp_path: Path) -> None:
    def drop(tensors: dict[str, Any]) -> None:
        del tensors["blk.1.attn_v_b.weight"], tensors["blk.2.exp_probs_b.bias"], tensors["blk.2.ffn_down_exps.weight"]

    path = write_deepseek_gguf(v3_dir, tmp_path / "gap.gguf", True, edit=drop)
    with pytest.raises(
        ModelPathError,
        match=r"lacks 3 tensors: blk\.1\.attn_v_b\.weight, blk\.2\.ffn_down_exps\.weight, blk\.2\.exp_probs_b\.bias",
    ):
        open_model_source(str(path))


def test_stack_of_the_wrong_expert_count_is_refused(v3_dir: Path, tmp_path: Path) -> None:
    def halve(tensors: dict[str, Any]) -> None:
        tensors["blk.1.ffn_up_exps.weight"] = tensors["blk.1.ffn_up_exps.weight"][:4]

    path = write_deepseek_gguf(v3_dir, tmp_path / "half.gguf", True, edit=halve)
    wrong = r"blk\.1\.ffn_up_exps\.weight has shape \(64, 32, 4\) \(ggml order\), not a stack of .*expert_count = 8"
    with pytest.raises(ModelPathError, match=wrong):
        open_model_source(str(path))


def test_unknown_gating_function_is_refused(v3_dir: Path, tmp_path: Path) -> None:
    path = write_deepseek_gguf(v3_dir, tmp_path / "gating.gguf", True)
    reader_fields = gguf.GGUFReader(path).fields
    assert reader_fields["deepseek2.expert_gating_func"].contents() == 2
    # Rewrite the one key in place: 3 is llama.cpp's sqrt-softplus gating, which DeepSeek-V2/V3 do not use.
    field = reader_fields["deepseek2.expert_gating_func"]
    data = bytearray(path.read_bytes())
    offset = field.offset + sum(part.nbytes for part in field.parts[:-1])
    data[offset : offset + 4] = np.uint32(3).tobytes()
    path.write_bytes(bytes(data))
    with pytest.raises(ModelPathError, match=r"expert_gating_func 3, which is not supported"):
        open_model_source(str(path))


def test_mixture_of_experts_llama_gguf_is_still_refused(tmp_path: Path) -> None:
    """A Mixtral-style llama GGUF: the deepseek2 path must not open MoE to the llama family."""
    writer = gguf.GGUFWriter(str(tmp_path / "mixtral.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(4)
    writer.add_expert_count(8)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((8, 64, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelPathError, match="is a mixture-of-experts llama model, which is not supported"):
        open_model_source(str(tmp_path / "mixtral.gguf"))
