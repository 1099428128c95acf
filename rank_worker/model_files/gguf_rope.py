"""Rope scaling of a GGUF, turned back into the HF `rope_scaling` dict the engine reads.

linear/yarn scaling is plain metadata. Llama 3.x "llama3" scaling is not: llama.cpp bakes it into a
`rope_freqs.weight` tensor holding one divisor per rotary frequency, so we recover the HF parameters
that produce exactly those divisors.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from rank_worker.model_files.source import ModelPathError

# Every Llama 3.1/3.2/3.3 release uses these; tried first so the usual files get the usual numbers.
_LLAMA3_DEFAULTS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_scaling_from_metadata(
    path: Path,
    arch: str,
    metadata: dict[str, Any],
    freq_factors: np.ndarray | None,
    rope_theta: float,
) -> dict[str, Any] | None:
    if freq_factors is not None:
        return llama3_scaling_from_factors(path, np.asarray(freq_factors, dtype=np.float64), rope_theta)
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor") or metadata.get(f"{arch}.rope.scale_linear")
    if kind in (None, "none") and not factor:
        return None
    kind = kind or "linear"  # old files only had rope.scale_linear
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        if original:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    raise ModelPathError(f"GGUF {path} uses rope scaling {kind!r}, which is not supported")


def llama3_scaling_from_factors(path: Path, factors: np.ndarray, rope_theta: float) -> dict[str, Any] | None:
    """HF llama3 rope_scaling reproducing `factors` (llama.cpp's per-frequency divisors), or an error."""
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    wavelengths = _wavelengths(len(factors), rope_theta)
    candidates = [dict(_LLAMA3_DEFAULTS)]
    fitted = _fit(factors, factor, wavelengths)
    if fitted is not None:
        candidates.append(fitted)
    for params in candidates:
        scaling = {"rope_type": "llama3", "factor": factor, **params}
        if np.allclose(llama3_divisors(scaling, wavelengths), factors, rtol=1e-4, atol=1e-4):
            return scaling
    raise ModelPathError(f"rope_freqs.weight in GGUF {path} matches no llama3 rope scaling; it is not supported")


def llama3_divisors(scaling: dict[str, Any], wavelengths: np.ndarray) -> np.ndarray:
    """What llama.cpp stores in rope_freqs for HF llama3 scaling: frequency i is divided by result[i].

    Long wavelengths are slowed by `factor`, short ones kept, and the band between blends the two linearly
    in original_max_position_embeddings / wavelength.
    """
    original = scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = np.clip((original / wavelengths - low) / (high - low), 0.0, 1.0)
    return 1.0 / ((1.0 - smooth) / scaling["factor"] + smooth)


def _wavelengths(num_freqs: int, rope_theta: float) -> np.ndarray:
    inv_freq = rope_theta ** (-np.arange(num_freqs, dtype=np.float64) * 2 / (2 * num_freqs))
    return 2 * math.pi / inv_freq


def _fit(factors: np.ndarray, factor: float, wavelengths: np.ndarray) -> dict[str, Any] | None:
    """Solve low/high_freq_factor from the blended band, where smooth is linear in 1/wavelength.

    Only the ratios original/low and original/high are determined, so original is fixed at Llama 3's 8192.
    """
    band = (factors > 1.0 + 1e-4) & (factors < factor - 1e-4)
    if band.sum() < 2:
        return None
    smooth = (1.0 / factors[band] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(1.0 / wavelengths[band], smooth, 1)
    original = _LLAMA3_DEFAULTS["original_max_position_embeddings"]
    width = original / slope  # high - low
    low = -intercept * width
    return {
        "low_freq_factor": float(low),
        "high_freq_factor": float(low + width),
        "original_max_position_embeddings": original,
    }
