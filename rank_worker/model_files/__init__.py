"""Reading model files: Hugging Face directories, GGUF files, config-only (random weights)."""
