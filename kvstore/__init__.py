"""The L1 host-memory KV tier: a later issue."""
