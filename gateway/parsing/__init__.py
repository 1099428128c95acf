"""Streaming parsers that turn model text into reasoning, text and tool calls without leaking markup."""
