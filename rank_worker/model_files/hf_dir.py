"""A Hugging Face model directory: config.json, *.safetensors (one file or sharded), tokenizer files."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from rank_worker.model_files.hf_config import load_hf_config, read_json
from rank_worker.model_files.hf_tokenizer import load_hf_tokenizer
from rank_worker.model_files.progress import TensorProgress
from rank_worker.model_files.source import ModelPathError, ModelSource, SkipTensor
from rank_worker.model_files.weights_digest import hf_weights_digest

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def open_hf_dir(directory: Path) -> ModelSource:
    if not directory.is_dir():
        raise ModelPathError(f"{directory} is not a directory (load_format 'hf' wants a Hugging Face model directory)")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelPathError(f"model directory {directory} has no config.json{_found_hint(directory)}")
    hf_config = load_hf_config(config_path)
    shards = find_shards(directory)
    names_by_shard = {shard: _tensor_names(shard) for shard in shards}
    tokenizer = load_hf_tokenizer(directory, hf_config)

    all_names = {name for names in names_by_shard.values() for name in names}
    if not hf_config["tie_word_embeddings"] and "lm_head.weight" not in all_names:
        # Saved without an output matrix, so the only way to run it is with the embedding reused as one.
        log.warning("%s has no lm_head.weight; treating the embeddings as tied", directory)
        hf_config["tie_word_embeddings"] = True

    def load_weights(skip: SkipTensor | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        if skip is None:
            return _iter_weights(names_by_shard)
        return _iter_weights(
            {shard: [name for name in names if not skip(name)] for shard, names in names_by_shard.items()}
        )

    index_path = directory / INDEX_FILE
    return ModelSource(
        model_id=model_id_for(directory),
        hf_config=hf_config,
        tokenizer=tokenizer,
        load_weights=load_weights,
        num_tensors=len(all_names),
        weights_digest=hf_weights_digest(directory, config_path, index_path if index_path.is_file() else None, shards),
    )


def find_shards(directory: Path) -> list[Path]:
    """The safetensors files holding the weights, in index order; every one checked to exist."""
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelPathError(f"{index_path} has no weight_map")
        shards = [directory / name for name in dict.fromkeys(weight_map.values())]
        missing = [shard.name for shard in shards if not shard.is_file()]
        if missing:
            raise ModelPathError(f"{index_path} names shards missing from {directory}: {', '.join(missing)}")
        return shards
    single = directory / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(directory.glob("*.safetensors"))
    if not found:
        raise ModelPathError(f"no *.safetensors in {directory}{_found_hint(directory)}")
    # Mistral repos ship consolidated.safetensors (mistral-inference names) next to the HF-named shards.
    hf_named = [path for path in found if not path.name.startswith("consolidated")]
    return hf_named or found


def model_id_for(directory: Path) -> str:
    """The directory name, or "org/name" for a Hugging Face hub cache snapshot (whose own name is a commit hash)."""
    directory = directory.resolve()
    repo_dir = directory.parent.parent
    if directory.parent.name == "snapshots" and repo_dir.name.startswith("models--"):
        return repo_dir.name.removeprefix("models--").replace("--", "/")
    return directory.name


def _tensor_names(shard: Path) -> list[str]:
    # Reads only the JSON header, so opening a big checkpoint stays cheap and a truncated file fails here.
    try:
        with safe_open(str(shard), framework="pt") as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own SafetensorError, not an OSError subclass
        raise ModelPathError(f"cannot read safetensors header of {shard}: {exc}") from exc


def _iter_weights(names_by_shard: dict[Path, list[str]]) -> Iterator[tuple[str, torch.Tensor]]:
    progress = TensorProgress("loading weights", sum(len(names) for names in names_by_shard.values()))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for shard, names in names_by_shard.items():
            if not names:
                continue  # every tensor of this file left out (the experts other ranks hold): not even opened
            progress.label(shard.name)
            # One tensor at a time off the memory map, so only the tensor in flight is resident (and a name left
            # out is never read).
            with safe_open(str(shard), framework="pt", device="cpu") as handle:
                for name in names:
                    yield name, handle.get_tensor(name)

    yield from progress.track(tensors())


def _found_hint(directory: Path) -> str:
    names = sorted(path.name for path in directory.iterdir())
    if not names:
        return " (the directory is empty)"
    shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
    return f" (found: {shown})"
