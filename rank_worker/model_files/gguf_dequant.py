"""GGUF tensors dequantized into float32 torch tensors in Hugging Face layout."""

from __future__ import annotations

from typing import Any

import gguf
import numpy as np
import torch


def dequantized(tensor: Any, index: int | None = None) -> torch.Tensor:
    """A float32 CPU tensor in HF layout. GGUF lists dims innermost first (ggml ne[0]), HF outermost first.

    index picks one entry of the outermost dim (one expert of a stacked [experts, rows, cols] tensor) and
    dequantizes only that entry.
    """
    data = tensor.data if index is None else tensor.data[index]
    values = gguf.quants.dequantize(data, tensor.tensor_type)
    # F32 data comes back as a view of the read-only memory map; torch needs memory it may own.
    values = np.array(values, dtype=np.float32, copy=not values.flags.writeable or values.dtype != np.float32)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return torch.from_numpy(values.reshape(shape if index is None else shape[1:]))
