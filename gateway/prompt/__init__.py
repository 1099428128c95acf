"""From a request's conversation to the served model's prompt text and tokens, and the output back to text."""
