"""Refuse, at load, config features our Llama-family code does not implement.

A config key the model code ignores does not fail: it loads and gives wrong logits (a Mistral with a 4K
sliding window served 32K deep, a quantized checkpoint read as plain weights). Every feature of the
supported families that changes the math is either implemented (rank_worker/model/llama.py) or refused
here with a message naming it. Transformers' semantics per model_type are the reference.
"""

from __future__ import annotations

from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_SILU = ("silu", "swish")
# Model types whose MLP takes biases from `mlp_bias` (the others ignore the key, as transformers does).
_MLP_BIAS_TYPES = ("llama", "smollm2", "smollm3")
# Model types whose sliding window follows use_sliding_window and per-layer layer_types.
_LAYER_TYPED_WINDOW_TYPES = ("qwen2", "qwen3", "smollm3")


class UnsupportedModelError(ValueError):
    """The config asks for something the engine does not implement; the message names it."""


def check_supported(hf: dict[str, Any], max_model_len: int) -> None:
    """Raise UnsupportedModelError naming every feature of `hf` (a normalized config.json) that our model code
    would silently get wrong when serving up to max_model_len tokens."""
    problems = unsupported_features(hf, max_model_len)
    if problems:
        model_type = hf.get("model_type", "llama")
        raise UnsupportedModelError(f"this {model_type} model cannot be served: " + "; ".join(problems))


def unsupported_features(hf: dict[str, Any], max_model_len: int) -> list[str]:
    """One message per unimplemented feature; [] when the config is fully supported."""
    model_type = str(hf.get("model_type", "llama"))
    problems: list[str] = []
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else quantization
        problems.append(
            f"quantized checkpoints (quantization_config: {method}) are not supported; "
            "use unquantized weights or a GGUF file"
        )
    activation = hf.get("hidden_act", "silu")
    if activation not in _SILU:
        problems.append(f"hidden_act {activation!r} is not implemented (only silu)")
    if hf.get("mlp_bias") and model_type in _MLP_BIAS_TYPES:
        problems.append("MLP biases (mlp_bias: true) are not implemented")
    problems += _rope_problems(hf)
    problems += _layer_problems(hf, model_type)
    window = smallest_sliding_window(hf)
    if window is not None and window < max_model_len:
        problems.append(
            f"sliding-window attention (sliding_window={window} < max_model_len={max_model_len}) is not "
            f"implemented; set max_model_len <= {window}"
        )
    return problems


def smallest_sliding_window(hf: dict[str, Any]) -> int | None:
    """The narrowest attention window any layer has under transformers' rules for this model_type, or None
    when every layer attends to the whole sequence."""
    model_type = str(hf.get("model_type", "llama"))
    window = hf.get("sliding_window")
    if model_type == "mistral":
        # MistralModeling applies sliding_window (default 4096) to every layer; it ignores layer_types.
        window = hf.get("sliding_window", 4096)
        return int(window) if window else None
    if model_type not in _LAYER_TYPED_WINDOW_TYPES or not hf.get("use_sliding_window") or not window:
        return None  # llama has no sliding window; the others only with use_sliding_window
    layers = sliding_layer_flags(hf)
    return int(window) if any(layers) else None


def sliding_layer_flags(hf: dict[str, Any]) -> list[bool]:
    """Per layer, whether it is a sliding-window layer, from layer_types or the model type's default."""
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types:
        return [kind == "sliding_attention" for kind in layer_types[:num_layers]]
    if hf.get("model_type") == "smollm3":  # the NoPE layers slide (SmolLM3Config.__post_init__)
        return [not use_rope for use_rope in rope_layer_flags(hf)]
    first_sliding = int(hf.get("max_window_layers", 28))  # Qwen2/Qwen3: the layers from max_window_layers on
    return [index >= first_sliding for index in range(num_layers)]


def rope_layer_flags(hf: dict[str, Any]) -> list[bool]:
    """Per layer, whether it applies rotary embedding: SmolLM3 leaves it out of some layers (NoPE), given as
    no_rope_layers (1 = rotary) or one layer in every no_rope_layer_interval; every other type uses it
    everywhere."""
    num_layers = int(hf["num_hidden_layers"])
    if hf.get("model_type") != "smollm3":
        return [True] * num_layers
    flags = hf.get("no_rope_layers")
    if flags is None:
        interval = int(hf.get("no_rope_layer_interval", 4))
        return [(index + 1) % interval != 0 for index in range(num_layers)]
    return [bool(flag) for flag in flags[:num_layers]]


def _rope_problems(hf: dict[str, Any]) -> list[str]:
    problems = []
    scaling = hf.get("rope_scaling") or {}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        problems.append(f"rope scaling {rope_type!r} is not implemented (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        problems.append(f"partial rotary embedding (partial_rotary_factor={partial}) is not implemented")
    return problems


def _layer_problems(hf: dict[str, Any], model_type: str) -> list[str]:
    num_layers = int(hf["num_hidden_layers"])
    problems = []
    layer_types = hf.get("layer_types")
    if layer_types and model_type != "mistral":
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            problems.append(f"layer types {', '.join(unknown)} are not implemented")
        if len(layer_types) < num_layers:
            problems.append(f"layer_types lists {len(layer_types)} layers for {num_layers}")
    flags = hf.get("no_rope_layers")
    if model_type == "smollm3" and flags is not None and len(flags) < num_layers:
        problems.append(f"no_rope_layers lists {len(flags)} layers for {num_layers}")
    return problems
