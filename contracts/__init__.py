"""What services share: the block hash, the typed configuration, KV events and the feed that publishes them,
internal auth, host:port addresses and the loopback rule, the id length limit, and the model types served (with
their prompt families)."""
