"""What opening model files gives the engine (ModelSource), whatever their format; opener.py opens them, and
each format's module (hf_dir.py, gguf_file.py, dummy.py) builds one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rank_worker.engine.interface import TokenizerBundle

LOAD_FORMATS = ("auto", "hf", "gguf", "dummy")

# True for an HF tensor name the model will not read (the routed experts another rank of its expert-parallel group
# holds: DeepseekForCausalLM.skipped_by_shard); the loader then leaves that tensor's bytes on disk.
SkipTensor = Callable[[str], bool]


class WeightLoader(Protocol):
    def __call__(self, skip: SkipTensor | None = None) -> Iterator[tuple[str, torch.Tensor]]: ...


class ModelPathError(Exception):
    """The model path is missing, incomplete or in a form we cannot read; the message says exactly what."""


@dataclass
class ModelSource:
    model_id: str
    hf_config: dict[str, Any]
    tokenizer: TokenizerBundle | None
    # Yields (HF parameter name, CPU tensor in HF layout) one at a time; each call starts a fresh pass, reading
    # only the tensors `skip` keeps. dtype is the checkpoint's for HF directories, float32 (dequantized) for GGUF.
    # None means "no weights on disk": the engine initialises random weights (load_format="dummy").
    load_weights: WeightLoader | None
    num_tensors: int
    # What defines the weights (weights_digest.py), part of the KV-cache namespace so that another checkpoint
    # under the same name never reads this one's cached KV. For random weights, only the config's part: the
    # engine adds the seed (random_weights_digest).
    weights_digest: str
