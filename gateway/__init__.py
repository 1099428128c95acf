"""The HTTP gateway (Anthropic Messages, OpenAI Chat Completions); its rooms: http/, api/, flow, ranks/, prompt/,
parsing/, observability/."""
