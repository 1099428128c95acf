"""OpenAI Chat Completions API: request schema, conversion to a ChatRequest, responses and SSE chunks."""
