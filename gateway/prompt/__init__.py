"""Turning a ChatRequest into the prompt text a model was trained on."""
