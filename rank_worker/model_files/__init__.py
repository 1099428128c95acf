"""Reading model files: Hugging Face directories, GGUF files, config-only (random weights)."""

from rank_worker.model_files.embedded import embedded_model_path
from rank_worker.model_files.opener import open_model_source
from rank_worker.model_files.source import ModelPathError, ModelSource

__all__ = ["ModelPathError", "ModelSource", "embedded_model_path", "open_model_source"]
