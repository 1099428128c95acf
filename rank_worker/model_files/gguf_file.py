"""A GGUF file (llama.cpp's format): metadata -> HF config and tokenizer, tensors -> HF-named float32 weights."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import gguf
import torch

from rank_worker.model_files.gguf_deepseek import (
    DEEPSEEK2,
    PlannedWeight,
    deepseek2_hf_config,
    iter_deepseek2_weights,
    plan_deepseek2_weights,
)
from rank_worker.model_files.gguf_dequant import dequantized
from rank_worker.model_files.gguf_rope import rope_scaling_from_metadata
from rank_worker.model_files.gguf_tokenizer import tokenizer_from_metadata
from rank_worker.model_files.progress import TensorProgress
from rank_worker.model_files.source import ModelPathError, ModelSource, SkipTensor, WeightLoader
from rank_worker.model_files.weights_digest import gguf_weights_digest

log = logging.getLogger(__name__)

# deepseek2 is DeepSeek-V2 or V3 (DeepseekV3ForCausalLM when its router scores by sigmoid): gguf_deepseek.py.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    DEEPSEEK2: "DeepseekV2ForCausalLM",
}

_TOP_LEVEL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Not weights of the HF model: rope_freqs holds llama3 rope factors, which become hf_config["rope_scaling"].
_NOT_WEIGHTS = {"rope_freqs.weight"}


def open_gguf(path: Path) -> ModelSource:
    if path.is_dir():
        path = _single_gguf_in(path)
    if not path.is_file():
        raise ModelPathError(f"GGUF file {path} does not exist")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError, struct/IndexError, OSError... on a bad file
        raise ModelPathError(f"{path} is not a readable GGUF file: {exc}") from exc
    metadata = {key: field.contents() for key, field in reader.fields.items()}
    tensors = {tensor.name: tensor for tensor in reader.tensors}

    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelPathError(
            f"GGUF {path} has architecture {arch!r}, which is not supported (supported: {', '.join(ARCHITECTURES)})"
        )
    if metadata.get(f"{arch}.expert_count") and arch != DEEPSEEK2:
        raise ModelPathError(f"GGUF {path} is a mixture-of-experts {arch} model, which is not supported")
    if (metadata.get("split.count") or 1) > 1:
        raise ModelPathError(
            f"GGUF {path} is one part of a split model; merge the parts first (llama-gguf-split --merge)"
        )
    if arch == DEEPSEEK2:
        hf_config = deepseek2_hf_config(path, metadata, tensors)
        plan = plan_deepseek2_weights(path, hf_config, tensors)
        num_tensors = sum(len(weight.hf_names) for weight in plan)
        load_weights: WeightLoader = partial(_load_deepseek2, plan, tensors)
    else:
        hf_config = _hf_config(path, arch, metadata, tensors)
        names = _hf_names(path, arch, tensors)
        _check_complete(path, arch, hf_config["num_hidden_layers"], tensors)
        num_tensors = len(names)
        load_weights = partial(_load_llama_family, arch, hf_config, names, tensors)
    _check_dequantizable(path, tensors)
    tokenizer = tokenizer_from_metadata(metadata, path)
    if tokenizer is not None:
        hf_config["bos_token_id"] = tokenizer.bos_token_id
        ids = tokenizer.eos_token_ids
        hf_config["eos_token_id"] = ids[0] if len(ids) == 1 else list(ids) or None

    return ModelSource(
        model_id=_model_id(path, metadata),
        hf_config=hf_config,
        tokenizer=tokenizer,
        load_weights=load_weights,
        num_tensors=num_tensors,
        weights_digest=gguf_weights_digest(
            path, reader.data_offset, [(t.data_offset, t.data_offset + t.n_bytes) for t in reader.tensors]
        ),
    )


def _single_gguf_in(directory: Path) -> Path:
    files = sorted(directory.glob("*.gguf"))
    if len(files) != 1:
        found = ", ".join(f.name for f in files) or "none"
        raise ModelPathError(f"expected exactly one *.gguf in {directory} (found: {found}); pass the file itself")
    return files[0]


def _hf_config(path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    def need(key: str) -> Any:
        value = metadata.get(f"{arch}.{key}")
        if value is None:
            raise ModelPathError(f"GGUF {path} lacks metadata {arch}.{key}")
        return value

    if "token_embd.weight" not in tensors:
        raise ModelPathError(f"GGUF {path} has no token_embd.weight tensor")
    hidden = int(need("embedding_length"))
    heads = int(need("attention.head_count"))
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        # Some files store one count per layer; the models we support use one count throughout.
        if len(set(kv_heads)) != 1:
            raise ModelPathError(f"GGUF {path} has per-layer head_count_kv {kv_heads}, which is not supported")
        kv_heads = kv_heads[0]
    head_dim = int(metadata.get(f"{arch}.attention.key_length") or hidden // heads)
    rope_theta = float(metadata.get(f"{arch}.rope.freq_base") or (10_000.0 if arch == "llama" else 1_000_000.0))
    rope_freqs = tensors.get("rope_freqs.weight")
    freq_factors = None if rope_freqs is None else gguf.quants.dequantize(rope_freqs.data, rope_freqs.tensor_type)
    return {
        "model_type": arch,
        "architectures": [ARCHITECTURES[arch]],
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float(metadata.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling_from_metadata(path, arch, metadata, freq_factors, rope_theta),
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length", 2048)),
        # The embedding matrix is the ground truth: some files pad it past the tokenizer's vocabulary.
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        # llama.cpp leaves output.weight out when the model reuses its embeddings as the output layer.
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "attention_output_bias": "blk.0.attn_output.bias" in tensors,
        "torch_dtype": "float32",
    }


def _hf_names(path: Path, arch: str, tensors: dict[str, Any]) -> dict[str, str]:
    """GGUF name -> HF name for every weight; any tensor we cannot place fails now rather than loading as garbage."""
    names, unknown = {}, []
    for name in tensors:
        if name in _NOT_WEIGHTS:
            continue
        hf_name = hf_tensor_name(name)
        # q/k norms exist only in qwen3; in another architecture they would be silently ignored by the engine.
        qk_norm = hf_name is not None and (".q_norm." in hf_name or ".k_norm." in hf_name)
        if hf_name is None or (qk_norm and arch != "qwen3"):
            unknown.append(name)
        else:
            names[name] = hf_name
    if unknown:
        shown = ", ".join(unknown[:8]) + (", ..." if len(unknown) > 8 else "")
        raise ModelPathError(f"GGUF {path} has {len(unknown)} tensors with no {arch} equivalent: {shown}")
    return names


def _check_complete(path: Path, arch: str, num_layers: int, tensors: dict[str, Any]) -> None:
    """Every layer has every weight its architecture needs; a gap would otherwise surface deep inside the engine."""
    leaves = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"]
    if arch == "qwen3":
        leaves += ["attn_q_norm", "attn_k_norm"]
    needed = ["output_norm.weight"] + [f"blk.{i}.{leaf}.weight" for i in range(num_layers) for leaf in leaves]
    missing = [name for name in needed if name not in tensors]
    if missing:
        shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
        raise ModelPathError(f"GGUF {path} lacks {len(missing)} tensors: {shown}")


def hf_tensor_name(gguf_name: str) -> str | None:
    if gguf_name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match[1]}.{_BLOCK_NAMES[match[2]]}.{match[3]}"


def _check_dequantizable(path: Path, tensors: dict[str, Any]) -> None:
    # Dequantize one row of each storage type present, so an exotic quantization fails at open, not mid-load.
    seen: set[int] = set()
    for tensor in tensors.values():
        if tensor.tensor_type in seen or tensor.data.ndim < 2:
            continue
        seen.add(tensor.tensor_type)
        try:
            gguf.quants.dequantize(tensor.data[:1], tensor.tensor_type)
        except NotImplementedError as exc:
            raise ModelPathError(f"GGUF {path}: cannot dequantize {tensor.name} ({exc})") from exc


def _load_deepseek2(
    plan: list[PlannedWeight], tensors: dict[str, Any], skip: SkipTensor | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    count = sum(1 for weight in plan for name in weight.hf_names if skip is None or not skip(name))
    return _track(count, iter_deepseek2_weights(plan, tensors, skip))


def _load_llama_family(
    arch: str, hf_config: dict[str, Any], names: dict[str, str], tensors: dict[str, Any], skip: SkipTensor | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    if skip is not None:
        names = {gguf_name: hf_name for gguf_name, hf_name in names.items() if not skip(hf_name)}
    return _track(len(names), _iter_weights(arch, hf_config, names, tensors))


def _track(count: int, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    return TensorProgress("dequantizing GGUF", count).track(weights)


def _iter_weights(
    arch: str, hf_config: dict[str, Any], names: dict[str, str], tensors: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    heads = {"attn_q": hf_config["num_attention_heads"], "attn_k": hf_config["num_key_value_heads"]}
    for gguf_name, hf_name in names.items():
        weight = dequantized(tensors[gguf_name])
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if arch == "llama" and kind in heads:
            weight = unpermute_rotary_rows(weight, heads[kind])
        yield hf_name, weight


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the row order llama.cpp's converter gives llama q/k projections.

    HF applies rotary embedding to the two halves of each head (dim i pairs with i + head_dim/2); llama.cpp pairs
    adjacent dims (2i with 2i+1), so its converter reorders each head's rows from [first half; second half] to
    interleaved (a0, b0, a1, b1, ...). Viewing the rows as (head, pair, half) and swapping the last two restores
    the halves. Works for biases (1-D) as well.
    """
    rows = weight.shape[0]
    half = rows // num_heads // 2
    if half * 2 * num_heads != rows:
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even size")
    rest = weight.shape[1:]
    return weight.reshape(num_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def _model_id(path: Path, metadata: dict[str, Any]) -> str:
    """Named like llama.cpp names GGUF files (basename-size-finetune-version-type): stable, and distinct for
    base vs instruct or two quantizations of one model, which must never share a KV cache."""
    base = metadata.get("general.basename") or metadata.get("general.name") or path.stem
    parts = [
        base,
        metadata.get("general.size_label"),
        metadata.get("general.finetune"),
        metadata.get("general.version"),
    ]
    file_type = metadata.get("general.file_type")
    if file_type is not None:
        try:
            parts.append(gguf.LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_"))
        except ValueError:
            parts.append(f"ftype{file_type}")
    return "-".join(re.sub(r"\s+", "-", str(part).strip()) for part in parts if part)
