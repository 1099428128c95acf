"""The continuous-batching engine: sequences, block pool, prefix cache, scheduler, model runner."""
