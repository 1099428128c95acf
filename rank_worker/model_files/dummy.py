"""load_format "dummy": a config.json alone; the engine makes random weights of its shape (tests, benchmarks)."""

from __future__ import annotations

from pathlib import Path

from rank_worker.model_files.hf_config import load_hf_config
from rank_worker.model_files.hf_tokenizer import load_hf_tokenizer
from rank_worker.model_files.source import ModelPathError, ModelSource
from rank_worker.model_files.weights_digest import config_digest


def open_dummy(target: Path) -> ModelSource:
    """`target` is a config.json or a directory holding one; a tokenizer.json beside it is used when present."""
    config_path = target / "config.json" if target.is_dir() else target
    if not config_path.is_file():
        raise ModelPathError(f"model directory {target} has no config.json")
    hf_config = load_hf_config(config_path)
    directory = config_path.parent
    tokenizer = load_hf_tokenizer(directory, hf_config) if (directory / "tokenizer.json").is_file() else None
    return ModelSource(
        # Named after the folder, so two configs in different folders never share a KV-cache namespace.
        model_id=directory.resolve().name,
        hf_config=hf_config,
        tokenizer=tokenizer,
        load_weights=None,
        num_tensors=0,
        weights_digest=config_digest(config_path),
    )
