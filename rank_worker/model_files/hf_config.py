"""Read a config.json and normalize it so the engine sees one spelling whatever transformers version wrote it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rank_worker.model_files.source import ModelPathError

# Without these the engine cannot even size the model; everything else has a default.
REQUIRED_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")

# Architectures whose attention projections always carry a bias even though their config has no key for it.
_BIAS_BY_DEFAULT = {"qwen2"}

# rope_theta the model classes assume when a config leaves it out.
_DEFAULT_ROPE_THETA = {"qwen2": 1_000_000.0, "qwen3": 1_000_000.0, "smollm3": 2_000_000.0}

# Architectures that tie the output layer to the embeddings unless their config says otherwise.
_TIED_BY_DEFAULT = {"smollm3"}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelPathError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelPathError(f"{path} is not a JSON object")
    return data


def load_hf_config(config_path: Path) -> dict[str, Any]:
    config = read_json(config_path)
    missing = [key for key in REQUIRED_KEYS if key not in config]
    if missing:
        raise ModelPathError(f"{config_path} lacks {', '.join(missing)}")
    return normalize_hf_config(config)


def normalize_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `config` that always has the keys the engine reads, filled with the model classes' defaults."""
    config = dict(config)
    model_type = config.get("model_type", "")
    heads = int(config["num_attention_heads"])
    config["head_dim"] = int(config.get("head_dim") or config["hidden_size"] // heads)
    config["num_key_value_heads"] = int(config.get("num_key_value_heads") or heads)
    config["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", model_type in _TIED_BY_DEFAULT))
    config["attention_bias"] = bool(config.get("attention_bias", model_type in _BIAS_BY_DEFAULT))
    config.setdefault("rms_norm_eps", 1e-6)
    config.setdefault("max_position_embeddings", 2048)
    theta, scaling = _rope_settings(config, _DEFAULT_ROPE_THETA.get(model_type, 10_000.0))
    config["rope_theta"] = theta
    config["rope_scaling"] = scaling
    # transformers 5 writes "dtype" where 4.x wrote "torch_dtype"; keep both so either reader finds it.
    if "dtype" in config or "torch_dtype" in config:
        dtype = config.get("dtype") or config.get("torch_dtype")
        config["dtype"] = config["torch_dtype"] = dtype
    return config


def _rope_settings(config: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the 4.x top-level keys or the 5.x `rope_parameters` dict."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        # Per-attention-type parameters (sliding vs full layers); the full-attention ones describe the model.
        params = params.get("full_attention") or next(iter(params.values()))
    params = dict(params) if isinstance(params, dict) else {}

    theta = config.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", default_theta)

    scaling = config.get("rope_scaling")
    if not isinstance(scaling, dict):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    # Old configs say "type"; the HF llama3-style dict the engine reads says "rope_type".
    if "type" in scaling:
        scaling.setdefault("rope_type", scaling.pop("type"))
    if scaling.get("rope_type", "default") == "default" and not set(scaling) - {"rope_type"}:
        return float(theta), None
    return float(theta), scaling
