"""How many KV blocks a rank holds: the model shape's KV bytes per token against what HBM leaves after weights
and activations, as rank_worker/engine/factory.py sizes the pool on CUDA (gpu_memory_utilization of the
device, minus the profiled peak of weights and a full-size prefill step)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from simulator import model_cost

SHAPES_DIR = Path(__file__).resolve().parent.parent / "bench" / "shapes"


@dataclass(frozen=True)
class ShapeFacts:
    name: str
    kv_bytes_per_token: int  # every layer's K and V (MLA: its latent and rotary key)
    weight_bytes: int
    max_context: int  # the trained window (max_position_embeddings)


def shape_facts(shape: str, dtype_bytes: int = 2) -> ShapeFacts:
    """Facts of bench/shapes/<shape>/config.json (or of a config.json path)."""
    path = Path(shape)
    if not path.suffix:
        path = SHAPES_DIR / shape / "config.json"
    if not path.is_file():
        known = ", ".join(sorted(p.name for p in SHAPES_DIR.iterdir() if p.is_dir())) if SHAPES_DIR.is_dir() else ""
        raise FileNotFoundError(f"no model shape {shape!r} (bench/shapes has: {known})")
    config = json.loads(path.read_text())
    return ShapeFacts(
        name=path.parent.name,
        kv_bytes_per_token=int(model_cost.kv_bytes_per_token(config, dtype_bytes)),
        weight_bytes=model_cost.total_params(config) * dtype_bytes,  # every expert of an MoE is resident
        max_context=int(config["max_position_embeddings"]),
    )


def kv_pool_blocks(
    facts: ShapeFacts, hbm_gb: float, gpu_memory_utilization: float, activation_gb: float, block_size: int
) -> int:
    """Blocks of block_size tokens that fit in what the device leaves the KV pool (GB = 10^9 bytes)."""
    budget = hbm_gb * 1e9 * gpu_memory_utilization - facts.weight_bytes - activation_gb * 1e9
    blocks = int(budget // (facts.kv_bytes_per_token * block_size))
    if blocks < 1:
        raise ValueError(
            f"{facts.name} leaves no room for a KV pool: {facts.weight_bytes / 1e9:.1f} GB of weights and "
            f"{activation_gb} GB of activations in {gpu_memory_utilization:.0%} of {hbm_gb} GB"
        )
    return blocks
