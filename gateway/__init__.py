"""The HTTP gateway (Anthropic Messages, OpenAI Chat Completions): a later issue."""
