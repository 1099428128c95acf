"""The Llama-family model written against the paged KV cache."""
