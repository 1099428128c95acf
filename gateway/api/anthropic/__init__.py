"""Anthropic Messages API: request schema, conversion to a ChatRequest, responses and SSE events."""
